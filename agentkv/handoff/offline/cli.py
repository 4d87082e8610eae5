"""``agentkv calibrate``, ``agentkv evaluate`` and ``agentkv bench handoff``.

torch and transformers are imported inside the ``run_*`` functions, so ``agentkv --help`` stays fast.

    agentkv calibrate --source small --target large --corpus docs/ --out mappers/small-large
    agentkv evaluate mappers/small-large [--corpus more-text/]
    agentkv bench handoff [--lengths 512,2048,8192] [--gpu]

A SPEC is an embedded model size (``tiny``/``small``/``large``, built by ``agentkv.embedded.engine.models``) or a
checkpoint folder.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterable

DEFAULT_BENCH_LENGTHS = "64,512,2048,8192"
LONG_BENCH_LENGTHS = "16384,32768"
GPU_BENCH_LENGTHS = "4096,8192,16384,32768"


def _lengths(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _add_model_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--source", required=required, help="source model SPEC (small/large or a checkpoint)")
    parser.add_argument("--target", required=required, help="target model SPEC")
    parser.add_argument("--seed", type=int, default=0, help="seed of embedded models (default 0)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per calibration sequence (default 512)")
    parser.add_argument("--max-tokens", type=int, default=131072, help="corpus tokens to use (default 131072)")
    parser.add_argument("--decode-tokens", type=int, default=8, help="greedy tokens decoded when evaluating")


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``agentkv calibrate``."""
    _add_model_arguments(parser, required=True)
    parser.add_argument("--corpus", required=True, help="a text file or a folder of text files")
    parser.add_argument("--out", required=True, help="directory to write the mapper to")
    parser.add_argument("--backend", default="ridge", help="ridge (default), mlp, or a registered backend")
    parser.add_argument("--k", type=int, default=8, help="source layers per target layer (default 8)")
    parser.add_argument("--lam", type=float, default=0.01, help="ridge penalty (default 0.01)")
    parser.add_argument("--heldout", type=float, default=0.2, help="held-out share of sequences (default 0.2)")
    parser.add_argument("--mlp-hidden", type=int, default=None, help="mlp hidden width (default kv_heads*head_dim)")
    parser.add_argument("--mlp-epochs", type=int, default=200, help="mlp epoch cap (default 200)")


def add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``agentkv evaluate``."""
    parser.add_argument("dir", help="a mapper directory written by `agentkv calibrate`")
    parser.add_argument("--corpus", help="re-evaluate on this text (else print the stored figures)")
    parser.add_argument("--write", action="store_true", help="store the re-evaluated figures in the manifest")
    parser.add_argument("--min-attention-cosine", type=float, default=None, help="gate floor (default 0.95)")
    _add_model_arguments(parser, required=False)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``agentkv bench``."""
    parser.add_argument("name", choices=["handoff"], help="which benchmark")
    parser.add_argument("--source", default="small", help="source SPEC (default small)")
    parser.add_argument("--target", default="large", help="target SPEC (default large)")
    parser.add_argument("--lengths", default=None,
                        help=f"comma-separated prompt lengths (default {DEFAULT_BENCH_LENGTHS})")
    parser.add_argument("--long", action="store_true", help=f"also {LONG_BENCH_LENGTHS} when memory allows")
    parser.add_argument("--mapper", help="time this calibrated mapper (default: random weights, real shapes)")
    parser.add_argument("--k", type=int, default=8, help="source layers per target layer of the random mapper")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per length (median)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--gpu", action="store_true",
                        help="Qwen3-14B -> 32B shapes, random bf16 weights, on --device (default cuda), "
                             f"lengths {GPU_BENCH_LENGTHS}")


def tqdm_progress(items: Iterable[Any], label: str) -> Iterable[Any]:
    """A tqdm bar per calibration phase."""
    from tqdm import tqdm

    return tqdm(items, desc=label, unit="step", leave=True)


def _load_models(source: str, target: str, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from agentkv.handoff.models import load_spec

    source_model, codec = load_spec(source, device=args.device, seed=args.seed)
    target_model, _ = load_spec(target, device=args.device, seed=args.seed)
    return source_model, target_model, codec


def run_calibrate(args: argparse.Namespace) -> int:
    """Collect, rank, fit and evaluate; write the mapper to ``--out`` and print its tables."""
    from agentkv.handoff.offline.calibration import calibrate
    from agentkv.handoff.offline.config import CalibrationConfig, MLPConfig
    from agentkv.handoff.offline.corpus import token_sequences
    from agentkv.handoff.errors import SignatureMismatchError

    source, target, codec = _load_models(args.source, args.target, args)
    sequences = token_sequences(args.corpus, codec, args.seq_len, args.max_tokens)
    config = CalibrationConfig(k=args.k, lam=args.lam, heldout_fraction=args.heldout,
                               eval_decode_tokens=args.decode_tokens,
                               mlp=MLPConfig(hidden=args.mlp_hidden, max_epochs=args.mlp_epochs))
    try:
        mapper = calibrate(source, target, sequences, backend=args.backend, config=config, progress=tqdm_progress)
    except SignatureMismatchError as refused:
        raise SystemExit(f"agentkv calibrate: refused: {refused}") from None
    mapper.info.update({"source_spec": args.source, "target_spec": args.target, "corpus": str(args.corpus)})
    mapper.save(args.out)
    _print_manifest(Path(args.out), None)
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    """Print a mapper's stored figures, or re-evaluate it on ``--corpus`` first."""
    from agentkv.handoff.registry import read_manifest

    folder = Path(args.dir)
    manifest = read_manifest(folder)
    if args.corpus:
        manifest = _reevaluate(folder, manifest, args)
    _print_manifest(folder, args.min_attention_cosine, manifest)
    return 0


def _reevaluate(folder: Path, manifest: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from agentkv.handoff.offline.corpus import token_sequences
    from agentkv.handoff.offline.evaluation import evaluate
    from agentkv.handoff.registry import MANIFEST, load_mapper

    source_spec = args.source or manifest.get("source_spec")
    target_spec = args.target or manifest.get("target_spec")
    if not source_spec or not target_spec:
        raise SystemExit("this mapper does not name its models: pass --source and --target")
    source, target, codec = _load_models(source_spec, target_spec, args)
    mapper = load_mapper(folder, source=source, target=target)
    sequences = token_sequences(args.corpus, codec, args.seq_len, args.max_tokens)
    figures = evaluate(mapper, source, target, sequences, decode_tokens=args.decode_tokens, progress=tqdm_progress)
    updated = {**manifest, "evaluation": {**figures.to_dict(), "heldout": True, "corpus": str(args.corpus)}}
    if args.write:
        (folder / MANIFEST).write_text(json.dumps(updated, indent=2, sort_keys=True) + "\n")
    return updated


def _print_manifest(folder: Path, floor: float | None, manifest: dict[str, Any] | None = None) -> None:
    from agentkv.handoff.plan import DEFAULT_MIN_ATTENTION_COSINE
    from agentkv.handoff.registry import read_manifest
    from agentkv.handoff.offline.report import layer_table, print_tables, summary_table

    manifest = manifest or read_manifest(folder)
    floor = DEFAULT_MIN_ATTENTION_COSINE if floor is None else floor
    cosine = manifest.get("evaluation", {}).get("attention_cosine")
    passed = cosine is not None and cosine >= floor
    verdict = f"{'map' if passed else 'replay'} (min_attention_cosine {floor:.2f})"
    print_tables(summary_table(manifest, verdict), layer_table(manifest))


def run_bench(args: argparse.Namespace) -> int:
    """Time map vs re-prefill and print the table."""
    import torch

    from agentkv.handoff.offline.bench import format_rows
    from agentkv.handoff.offline.report import bench_table, print_tables

    if args.threads:
        torch.set_num_threads(args.threads)
    rows, title = _bench_gpu(args) if args.gpu else _bench_models(args)
    print_tables(bench_table(format_rows(rows), title))
    return 0


def _bench_models(args: argparse.Namespace) -> tuple[list[Any], str]:
    import torch

    from agentkv.handoff.offline.bench import bench_models
    from agentkv.handoff.models import load_spec
    from agentkv.handoff.registry import load_mapper

    source, _ = load_spec(args.source, device=args.device)
    target, _ = load_spec(args.target, device=args.device)
    lengths = _lengths(args.lengths or DEFAULT_BENCH_LENGTHS) + (_lengths(LONG_BENCH_LENGTHS) if args.long else [])
    mapper = load_mapper(args.mapper, source=source, target=target) if args.mapper else None
    rows = bench_models(source, target, lengths, mapper=mapper, k=args.k, repeats=args.repeats)
    weights = "calibrated" if mapper else "random weights"
    count = torch.get_num_threads()
    threads = f", {count} thread{'s' if count != 1 else ''}" if args.device == "cpu" else ""
    return rows, f"{args.source} -> {args.target} on {args.device}{threads} ({weights}, median of {args.repeats})"


def _bench_gpu(args: argparse.Namespace) -> tuple[list[Any], str]:
    import torch

    from agentkv.handoff.offline.bench import bench_shapes, qwen3_config

    device = "cuda" if args.device == "cpu" else args.device
    lengths = _lengths(args.lengths or GPU_BENCH_LENGTHS)
    rows = bench_shapes(qwen3_config("14b"), qwen3_config("32b"), lengths, device=device, dtype=torch.bfloat16,
                        k=args.k, repeats=args.repeats)
    return rows, f"Qwen3-14B -> Qwen3-32B shapes, bf16, random weights, on {device} (median of {args.repeats})"
