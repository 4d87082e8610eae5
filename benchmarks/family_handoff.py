"""KV mapper figures on a trained family: ridge and mlp on the related, unrelated and other-tokenizer pairs.

    agentkv train-family --recipe full            # first (cached afterwards)
    python benchmarks/family_handoff.py [--recipe full | --family DIR] [--backends ridge,mlp] [--out mappers/]

Every calibration runs through the CLI (``agentkv calibrate``, then ``agentkv evaluate DIR``), on the
family's held-out standard-library files, and the figures are read back from each mapper's manifest:
held-out R² (mean over target layers, keys and values, in the fitted space), attention-output cosine,
greedy next-token agreement and mean KL over ``--decode-tokens`` steps decoded from the mapped cache,
and the quality gate's decision at its default floor. A pair the signature check refuses is reported
with the refusal.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

PAIRS = (("related", "small"), ("unrelated", "small-unrelated"), ("other tokenizer", "small-othertok"))


def calibrate(family: Path, source: str, backend: str, out: Path, args: argparse.Namespace) -> str | None:
    """Run ``agentkv calibrate`` and ``agentkv evaluate``; the refusal message if calibrate refused."""
    command = [sys.executable, "-m", "agentkv.cli", "calibrate", "--source", str(family / source),
               "--target", str(family / "large"), "--corpus", str(family / "corpus"), "--out", str(out),
               "--backend", backend, "--seq-len", str(args.seq_len), "--max-tokens", str(args.max_tokens),
               "--decode-tokens", str(args.decode_tokens)]
    print("$", " ".join(command), flush=True)
    done = subprocess.run(command, stderr=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        refusal = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        print(refusal, flush=True)
        return refusal
    subprocess.run([sys.executable, "-m", "agentkv.cli", "evaluate", str(out)], check=True)
    return None


def row(pair: str, backend: str, out: Path, refusal: str | None) -> dict[str, Any]:
    """One table row from a mapper's manifest (or its refusal)."""
    if refusal is not None:
        return {"pair": pair, "backend": backend, "gate": f"refused at calibration: {refusal}"}
    from agentkv.handoff import choose_handoff, load_mapper

    manifest = json.loads((out / "manifest.json").read_text())
    r2, figures = manifest["calibration"]["heldout_r2"], manifest["evaluation"]
    plan = choose_handoff(load_mapper(out))
    return {"pair": pair, "backend": backend, "r2_keys": _mean(r2["keys"]), "r2_values": _mean(r2["values"]),
            "attention_cosine": figures["attention_cosine"], "greedy_agreement": figures["greedy_agreement"],
            "mean_kl": figures["mean_kl"], "decode_tokens": figures["decode_tokens"], "tokens": figures["tokens"],
            "gate": "map" if not plan.replay else "replay"}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table."""
    lines = ["| pair | backend | R² keys | R² values | attn-output cosine | greedy agreement | KL | gate |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if "attention_cosine" not in r:
            lines.append(f"| {r['pair']} | {r['backend']} | – | – | – | – | – | {r['gate']} |")
            continue
        lines.append(f"| {r['pair']} | {r['backend']} | {r['r2_keys']:.3f} | {r['r2_values']:.3f} | "
                     f"{r['attention_cosine']:.4f} | {r['greedy_agreement']:.3f} | {r['mean_kl']:.4f} | {r['gate']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/family_handoff.py", description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="full", help="find the cached family of this recipe (default full)")
    parser.add_argument("--family", default=None, help="a family folder (default: the recipe's cache folder)")
    parser.add_argument("--backends", default="ridge,mlp")
    parser.add_argument("--pairs", default=",".join(source for _, source in PAIRS),
                        help="source members to pair with large (default all three)")
    parser.add_argument("--out", default="mappers/family", help="where the mappers are written")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (the full recipe's context)")
    parser.add_argument("--max-tokens", type=int, default=65536)
    parser.add_argument("--decode-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    from agentkv.embedded.family import FamilyPaths, family_root, resolve_recipe

    family = Path(args.family) if args.family else family_root(resolve_recipe(args.recipe))
    rows = []
    for backend in args.backends.split(","):
        for pair, source in PAIRS:
            if source not in args.pairs.split(","):
                continue
            out = Path(args.out) / f"{source}-{backend}"
            refusal = calibrate(family, source, backend, out, args)
            rows.append(row(pair, backend, out, refusal))
    print(json.dumps({"family": str(family), "training": FamilyPaths(family).report(), "rows": rows}, indent=1))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
