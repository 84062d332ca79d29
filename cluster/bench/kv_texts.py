"""The fixed text set of `tandem bench kv-accuracy`: prose, a dialogue, instructions, numbers
and code, each a few hundred tokens, so that keys and values of many kinds of context are
quantized. Written for this benchmark; changing them changes every figure measured with them.
"""

TEXTS = (
    # narrative prose
    "The lighthouse keeper had not spoken to anyone in eleven days when the supply boat "
    "finally rounded the point. She watched it from the gallery, one hand on the cold iron "
    "rail, counting the seconds between the swells that lifted its bow. The boat was late, "
    "as it always was in October, and the man at the tiller was new. He waved as if they "
    "were old friends. She did not wave back, but she went down the spiral stairs anyway, "
    "all one hundred and twelve of them, and was standing on the landing when he threw the "
    "line. Inside the crates there would be flour, lamp oil, a sack of potatoes, letters "
    "from her sister, and, if the harbour master had remembered, a new wick for the great "
    "lamp. The old one had begun to smoke, and the smoke left a faint brown film on the "
    "lens that she polished away every morning before she slept.",
    # explanatory, scientific
    "Photosynthesis converts light energy into chemical energy stored in sugar. In the "
    "light-dependent reactions, which take place in the thylakoid membranes of the "
    "chloroplast, chlorophyll absorbs photons and uses their energy to split water "
    "molecules, releasing oxygen as a by-product. The electrons freed in this process pass "
    "along an electron transport chain, pumping protons across the membrane; the resulting "
    "gradient drives ATP synthase, which produces ATP. A second photosystem re-energizes "
    "the electrons so that they can reduce NADP+ to NADPH. In the Calvin cycle, which runs "
    "in the stroma, the enzyme RuBisCO fixes carbon dioxide onto a five-carbon sugar, and "
    "ATP and NADPH from the light reactions power the steps that turn the products into "
    "glyceraldehyde 3-phosphate, the starting point for glucose and many other molecules.",
    # dialogue
    "\"Did you lock the back door?\" Maya asked, without looking up from her book.\n"
    "\"I think so,\" said Tom.\n"
    "\"You think so, or you did?\"\n"
    "\"I remember reaching for the key. I don't remember turning it.\"\n"
    "She closed the book on her finger. \"Then you didn't.\"\n"
    "\"That's not how memory works. Just because I can't remember doing something doesn't "
    "mean I didn't do it. I brush my teeth every night and I couldn't tell you a single "
    "thing about last Tuesday's brushing.\"\n"
    "\"Last Tuesday's brushing didn't leave the house open to the whole street.\"\n"
    "Tom sighed, stood up, and walked down the hall. A moment later she heard the click "
    "of the lock, and then, after a pause, the click of it being unlocked and locked again, "
    "just to be sure.",
    # instructions
    "How to repot a houseplant. First, choose a new pot that is only one or two inches "
    "wider than the old one; a pot that is much larger holds too much wet soil and can rot "
    "the roots. Water the plant a day before, so that the root ball slides out in one "
    "piece. Turn the old pot on its side, support the base of the stems with one hand, and "
    "tap the rim until the plant comes free. Gently loosen the outer roots with your "
    "fingers, and trim any that are black, mushy, or circling tightly around the bottom. "
    "Put a layer of fresh potting mix in the new pot, set the plant so that the top of the "
    "root ball sits about an inch below the rim, and fill in around the sides, pressing "
    "lightly to remove large air pockets. Water thoroughly until it drains from the holes, "
    "and keep the plant out of direct sun for a week while it recovers.",
    # numbers and a table
    "Quarterly report, all figures in thousands of dollars. Revenue: Q1 1,240; Q2 1,385; "
    "Q3 1,512; Q4 1,698, for a total of 5,835, up 14.2% from the previous year. Operating "
    "costs: Q1 980; Q2 1,010; Q3 1,064; Q4 1,121. Operating margin rose from 21.0% in the "
    "first quarter to 34.0% in the fourth. Headcount grew from 42 to 57 employees. The "
    "largest customer accounted for 18% of revenue, down from 26%, and the ten largest "
    "together for 61%. Cash on hand at year end was 2,310, against 1,475 a year earlier. "
    "Capital expenditure of 415 went mainly to a second warehouse (290) and new delivery "
    "vehicles (96). The board proposes a dividend of 0.12 per share, payable on March 15 "
    "to shareholders of record on February 28.",
    # source code
    "def merge_intervals(intervals):\n"
    "    \"\"\"Merge overlapping [start, end] intervals and return them sorted.\"\"\"\n"
    "    if not intervals:\n"
    "        return []\n"
    "    intervals = sorted(intervals, key=lambda pair: pair[0])\n"
    "    merged = [list(intervals[0])]\n"
    "    for start, end in intervals[1:]:\n"
    "        last = merged[-1]\n"
    "        if start <= last[1]:\n"
    "            last[1] = max(last[1], end)\n"
    "        else:\n"
    "            merged.append([start, end])\n"
    "    return merged\n"
    "\n"
    "\n"
    "def test_merge_intervals():\n"
    "    assert merge_intervals([]) == []\n"
    "    assert merge_intervals([[1, 3], [2, 6], [8, 10], [15, 18]]) == [[1, 6], [8, 10], "
    "[15, 18]]\n"
    "    assert merge_intervals([[1, 4], [4, 5]]) == [[1, 5]]\n"
    "    assert merge_intervals([[5, 7], [1, 2]]) == [[1, 2], [5, 7]]\n",
    # history, long sentences
    "The printing press did not change Europe overnight. For decades after Gutenberg's "
    "workshop in Mainz produced its famous Bible in the 1450s, most books were still "
    "religious texts, legal codes and school grammars, printed in Latin for a small "
    "educated readership. Yet the economics had shifted in a way that could not be undone: "
    "a page that once took a scribe hours could now be copied hundreds of times in a day, "
    "and the price of a book fell steadily. By 1500 presses were operating in more than two "
    "hundred and fifty towns, and perhaps twenty million volumes had been printed. Cheaper "
    "books meant more readers, more readers meant a market for pamphlets, almanacs and "
    "vernacular poetry, and that market, in turn, helped spread the arguments of reformers, "
    "scientists and political writers faster than any authority could suppress them.",
    # a recipe-like list with short lines
    "Ingredients for the lentil soup:\n"
    "- 2 tablespoons olive oil\n"
    "- 1 large onion, diced\n"
    "- 2 carrots, peeled and diced\n"
    "- 2 celery stalks, diced\n"
    "- 3 cloves garlic, minced\n"
    "- 1 teaspoon ground cumin\n"
    "- 1/2 teaspoon smoked paprika\n"
    "- 1 cup dried red lentils, rinsed\n"
    "- 1 can (400 g) chopped tomatoes\n"
    "- 5 cups vegetable stock\n"
    "- juice of half a lemon\n"
    "- salt and pepper to taste\n"
    "Heat the oil in a large pot over medium heat. Add the onion, carrots and celery and "
    "cook for eight minutes, until soft. Stir in the garlic and spices for one minute, then "
    "add the lentils, tomatoes and stock. Simmer for twenty-five minutes, blend half of the "
    "soup, stir it back in, and finish with the lemon juice.",
)

# greedy chat answers, both caches: how often a user would see a different answer
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn rain.",
    "What is 17 multiplied by 23?",
    "Name the planets of the solar system in order.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
)
