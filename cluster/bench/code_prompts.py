"""Code-editing prompts for W5 on real models: a function to rewrite, so that the answer
copies most of the prompt (prompt lookup's best case) and a small coder model can guess most
of what a larger one writes (a draft model's)."""

from pathlib import Path

FUNCTIONS = [
    '''def mean(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)''',
    '''def find_user(users, name):
    for user in users:
        if user["name"] == name:
            return user
    return None''',
    '''def read_lines(path):
    f = open(path)
    lines = f.readlines()
    f.close()
    return [line.strip() for line in lines]''',
    '''def count_words(text):
    counts = {}
    for word in text.split():
        if word in counts:
            counts[word] += 1
        else:
            counts[word] = 1
    return counts''',
    '''def fizzbuzz(n):
    out = []
    for i in range(1, n + 1):
        if i % 15 == 0:
            out.append("FizzBuzz")
        elif i % 3 == 0:
            out.append("Fizz")
        elif i % 5 == 0:
            out.append("Buzz")
        else:
            out.append(str(i))
    return out''',
    '''def merge(a, b):
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] < b[j]:
            result.append(a[i])
            i += 1
        else:
            result.append(b[j])
            j += 1
    return result + a[i:] + b[j:]''',
]
TASK = "Add type hints and a docstring to this Python function. Reply with the whole function.\n\n"


def code_prompts(folder: Path, count: int) -> list[list[int]]:
    """``count`` prompts (the functions in turn), in the model's chat template when it has
    one, as token ids."""
    return templated_prompts(folder, [TASK + "```python\n" + FUNCTIONS[i % len(FUNCTIONS)]
                                      + "\n```" for i in range(count)])


def chat_prompts(folder: Path, count: int) -> list[list[int]]:
    """``count`` of the questions `tandem draft-head train` holds out by default (the last of
    its built-in set, in turn): what a head trained by it has not seen."""
    from cluster.draft_head_prompts import QUESTIONS

    held_out = QUESTIONS[-8:]
    return templated_prompts(folder, [held_out[i % len(held_out)] for i in range(count)])


def templated_prompts(folder: Path, texts: list[str]) -> list[list[int]]:
    """Each text as a user turn in the model's chat template when it has one, as token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompts = []
    for text in texts:
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)
            # transformers 5 returns a BatchEncoding here, 4 a list
            prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        else:
            prompts.append(tokenizer(text)["input_ids"])
    return prompts
