"""BENCHMARK-ONLY: what one token's mask costs the grammar engine (llguidance), with no server: a walk through
each constraint where every token is drawn uniformly among those the mask allows (what a random-weight model
writes under the mask), timing each `compute_bitmask`.

    .venv/bin/python bench/mask_cost.py [--preset llama-3-8b] [--corpus] [--schema bench/data/device_schema.json]
                                        [--slices ours general] [--walks 4] [--max-tokens 128] [--out FILE]

`--slices` compares llguidance's slicer configurations: `ours` (gateway/structured/grammar.py's MASK_SLICES, what
the gateway runs), `general` (llguidance's default) and `none`. The vocabulary is bench/structured_vocab.py's
for `--preset` (the size, BOS and EOS of the model; word-like pieces, not the model's own tokenizer). Prints, per
slice set, the mean / P50 / P90 / P99 / max mask time and the share over 1 ms; `--out` writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import llguidance
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gateway.structured.constraint import Constraint  # noqa: E402
from gateway.structured.grammar import MASK_SLICES, PARSER_LIMITS, grammar_text  # noqa: E402
from structured_vocab import build_tokenizer  # noqa: E402

SLICE_SETS = {"ours": MASK_SLICES, "general": None, "none": []}


def constraints(use_corpus: bool, schema_files: list[str]) -> list[Constraint]:
    items = [Constraint("json_schema", Path(f).read_text(), "response_format") for f in schema_files]
    if use_corpus:
        from tests.gateway.schemas.corpus import CHOICES, REGEXES, json_schemas
        items += [Constraint("json_schema", json.dumps(s), "response_format") for s in json_schemas()]
        items += [Constraint("regex", r, "structured_outputs.regex") for r in REGEXES]
        items += [Constraint("choice", json.dumps(c), "structured_outputs.choice") for c in CHOICES]
    return items


def walk_times(ll_tokenizer, grammar: str, vocab_size: int, rng: random.Random, max_tokens: int) -> list[float]:
    """Seconds of each mask after the first (the first is computed once per grammar and cached by the gateway)."""
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits(**PARSER_LIMITS))
    times = []
    for i in range(max_tokens):
        started = time.perf_counter()
        words = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        if i:
            times.append(time.perf_counter() - started)
        allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size])
        if matcher.is_stopped() or matcher.is_error() or not len(allowed):
            break
        if not matcher.consume_token(int(allowed[rng.randrange(len(allowed))])):
            raise RuntimeError(f"a token its own mask allowed was refused: {matcher.get_error()}")
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--corpus", action="store_true", help="the test corpus's constraints (200+ schemas)")
    parser.add_argument("--schema", action="append", default=[], help="a JSON schema file (repeatable)")
    parser.add_argument("--slices", nargs="+", default=["ours", "general"], choices=sorted(SLICE_SETS))
    parser.add_argument("--walks", type=int, default=4, help="walks per constraint")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    from gpu_backend.models.presets import PRESETS  # the preset's vocabulary size, BOS and EOS
    config = PRESETS[args.preset]
    vocab_size, bos, eos = config.vocab_size, config.bos_token_id, list(config.eos_token_ids)
    tokenizer = build_tokenizer(vocab_size, bos, eos).to_str()
    items = constraints(args.corpus, args.schema or ([] if args.corpus else [str(ROOT / "bench/data/device_schema.json")]))
    grammars = [grammar_text(c) for c in items]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    report = {"commit": commit, "preset": args.preset, "vocab_size": vocab_size, "constraints": len(items),
              "walks": args.walks, "max_tokens": args.max_tokens, "results": {}}
    for name in args.slices:
        started = time.perf_counter()
        ll_tokenizer = llguidance.LLTokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos, slices=SLICE_SETS[name])
        build_s = time.perf_counter() - started
        rng, times = random.Random(args.seed), []
        for grammar in grammars:
            for _ in range(args.walks):
                times += walk_times(ll_tokenizer, grammar, vocab_size, rng, args.max_tokens)
        us = np.array(times) * 1e6
        row = {"tokenizer_build_s": round(build_s, 3), "masks": len(us), "mean_us": round(float(us.mean()), 1),
               **{f"p{q}_us": round(float(np.percentile(us, q)), 1) for q in (50, 90, 99)},
               "max_us": round(float(us.max()), 1), "over_1ms_pct": round(float((us > 1000).mean() * 100), 2)}
        report["results"][name] = row
        print(f"{name:8s} build {build_s:.2f} s, {row['masks']} masks: mean {row['mean_us']:.0f} us, P50 "
              f"{row['p50_us']:.0f}, P90 {row['p90_us']:.0f}, P99 {row['p99_us']:.0f}, max {row['max_us']:.0f}, "
              f"over 1 ms {row['over_1ms_pct']:.1f}%", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
