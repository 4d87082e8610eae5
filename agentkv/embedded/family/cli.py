"""``agentkv train-family``: train (or find cached) a model family and print what it holds.

    agentkv train-family                               # the full recipe, into ~/.cache/agentkv/family/
    agentkv train-family --recipe micro --out fam/     # seconds; what the tests use
    agentkv train-family --minutes 30 --only small,large

Then ``agentkv serve --model DIR/small`` serves a member and ``agentkv calibrate --source DIR/small
--target DIR/large --corpus DIR/corpus --out mappers/fam`` fits a mapper on held-out text.
"""

from __future__ import annotations

import argparse
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``train-family`` subcommand's options."""
    parser.add_argument("--recipe", default="full", choices=["micro", "full"], help="which recipe (default full)")
    parser.add_argument("--out", default=None, help="family folder (default ~/.cache/agentkv/family/<recipe key>)")
    parser.add_argument("--minutes", type=float, default=None,
                        help="scale every member's steps to this small+large budget (changes the cache key)")
    parser.add_argument("--seed", type=int, default=None, help="the family's seed (default the recipe's)")
    parser.add_argument("--only", default=None, help="comma-separated members (default all four)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default the recipe's)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Train what is missing, then print one line per member."""
    from agentkv.embedded.family import ensure_family, resolve_recipe

    recipe = resolve_recipe(args.recipe, minutes=args.minutes, seed=args.seed)
    only = [name.strip() for name in args.only.split(",")] if args.only else None
    began = time.monotonic()
    paths = ensure_family(recipe, out=args.out, progress=not args.no_progress, only=only, threads=args.threads)
    print(f"family {recipe.key()} at {paths.root} ({time.monotonic() - began:.0f} s this run)")
    print(f"{'member':<16} {'params':>10} {'steps':>6} {'tokens':>10} {'train s':>8} {'held-out loss':>14}")
    for name, info in paths.report().items():
        print(f"{name:<16} {info['parameters']:>10,} {info['steps']:>6} {info['tokens']:>10,} "
              f"{info['seconds']:>8.1f} {info['heldout_loss']:>14.4f}")
    print(f"serve:     agentkv serve --model {paths.small}")
    print(f"calibrate: agentkv calibrate --source {paths.small} --target {paths.large} --corpus {paths.corpus} "
          f"--out mappers/family")
    return 0
