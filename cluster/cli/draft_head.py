"""`tandem draft-head train`: an EAGLE-3 head for a catalog model (cluster/draft_head.py)."""

import argparse
import json
from pathlib import Path

from cluster.engine.config import DEFAULT_MODEL


def add_draft_head_command(subparsers: argparse._SubParsersAction) -> None:
    head = subparsers.add_parser("draft-head", help="build speculative-decoding draft heads")
    actions = head.add_subparsers(dest="draft_head_action", required=True)
    train = actions.add_parser("train", help="train an EAGLE-3 head on the model's own answers")
    train.add_argument("--model", default=DEFAULT_MODEL, help="catalog name or model folder")
    train.add_argument("--output", required=True, help="the head's folder")
    train.add_argument("--questions", type=int, default=48,
                       help="built-in questions answered for training")
    train.add_argument("--self-written", type=int, default=0,
                       help="questions the model writes itself (Magpie) and answers")
    train.add_argument("--held-out", type=int, default=8,
                       help="built-in questions kept for measuring acceptance (0: none)")
    train.add_argument("--max-tokens", type=int, default=256, help="tokens an answer")
    train.add_argument("--epochs", type=int, default=3)
    train.add_argument("--ttt-steps", type=int, default=3,
                       help="training-time test steps (the drafts a chain learns)")
    train.add_argument("--lr", type=float, default=3e-4)
    train.add_argument("--pack-tokens", type=int, default=256,
                       help="tokens a training step: answers packed end to end up to this "
                       "(default %(default)s, about one answer: 2,048 made ten times fewer "
                       "steps at the same --lr and a worse head, docs/experiments.md)")
    train.add_argument("--draft-vocab", type=int, default=8192,
                       help="the head's vocabulary: the answers' most frequent tokens")
    train.add_argument("--init", help="a head this command wrote: train it further (its "
                       "draft vocabulary kept)")
    train.add_argument("--k", type=int, default=3, help="drafts a step when measuring")
    train.add_argument("--device", default="auto", help="auto (cuda when present, else cpu) | "
                       "cpu | cuda | cuda:N")
    train.add_argument("--noise", type=float, default=0.05,
                       help="Gaussian noise on the target's features in training, in "
                       "their overall spread (0: none)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--train-seconds", type=float,
                       help="the most seconds training may take (after the answers): the "
                       "learning-rate schedule runs to its end by then (a device call's limit)")
    train.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace) -> int:
    from cluster.draft_head import train_draft_head

    for name in ("questions", "epochs", "ttt_steps", "draft_vocab", "k", "max_tokens",
                 "pack_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.train_seconds is not None and args.train_seconds <= 0:
        raise ValueError(f"--train-seconds must be above 0, got {args.train_seconds}")
    if args.noise < 0:
        raise ValueError(f"--noise must be at least 0, got {args.noise}")
    report = train_draft_head(
        args.model, Path(args.output), questions=args.questions,
        self_written=args.self_written, max_tokens=args.max_tokens, epochs=args.epochs,
        steps=args.ttt_steps, lr=args.lr, draft_vocab=args.draft_vocab,
        held_out=args.held_out, k=args.k, device=args.device, seed=args.seed,
        pack_tokens=args.pack_tokens, noise=args.noise, init=Path(args.init) if args.init else None,
        time_limit=args.train_seconds)
    print(json.dumps(report, indent=2))
    return 0
