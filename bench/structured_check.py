"""Are a server's constrained answers valid? Before a structured-output benchmark measures, this sends requests
under a JSON schema (chat `response_format`, not streamed) and validates every answer that ended (`stop`).

    python bench/structured_check.py --url http://127.0.0.1:8000/v1 --schema schema.json --num-requests 16

A random-weight model writes noise wherever the mask lets it, so an answer ends only where the schema bounds
every string and array (give such a schema and enough --max-tokens): an unbounded string runs to max_tokens,
which is counted (`length`), never called valid. Validation with `jsonschema` where it is installed, else parsing
and the schema's required keys. Exit 1 if an ended answer is invalid, a request failed, or none ended.
Then, with --compile-repeats R: R one-token requests, each under a schema the server has not seen (a new
`title`: compiled now) and again under the same one (cached); the median difference estimates what compiling
costs a request (cold minus cached; the first constrained request of a model also builds the grammar engine's
tokenizer, which the check's requests have done before this).
With --corpus instead of --schema: one request per constraint of the test corpus (tests/gateway/schemas/corpus.py:
200+ JSON schemas of real-world shapes, regexes and choice lists, the last two through vLLM's `structured_outputs`),
each ended answer checked against its own constraint (a regex with Python's `re.fullmatch`).
Standard library only (plus jsonschema if present): it runs where only the benchmark's client does.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def ask(url: str, api_key: str | None, model: str, schema: dict, max_tokens: int, index: int,
        constraint: dict | None = None) -> dict:
    """One constrained chat request (under `schema`, or the request fields `constraint` when given):
    {"finish_reason", "content"} or {"error"}."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "seed": index,
            "messages": [{"role": "user", "content": f"w{index} w{index + 1} w{index + 2}"}],
            **(constraint or {"response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "check", "schema": schema}}})}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url + "/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            choice = json.loads(resp.read())["choices"][0]
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        detail = exc.read().decode()[:300] if isinstance(exc, urllib.error.HTTPError) else ""
        return {"error": f"{type(exc).__name__}: {exc} {detail}".strip()}
    return {"finish_reason": choice["finish_reason"], "content": choice["message"]["content"]}


def corpus() -> list[tuple[dict, object]]:
    """(request fields, validator: text -> error or None) for every constraint of the test corpus."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.gateway.schemas.corpus import CHOICES, REGEXES, json_schemas

    def schema_item(schema):
        fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "corpus", "schema": schema}}}
        return fields, lambda text: validation_error(text, schema)

    def regex_item(pattern):
        return ({"structured_outputs": {"regex": pattern}},
                lambda text: None if re.fullmatch(pattern, text) else f"does not match {pattern!r}")

    def choice_item(choices):
        return ({"structured_outputs": {"choice": choices}},
                lambda text: None if text in choices else f"not one of {choices}")
    return ([schema_item(s) for s in json_schemas()] + [regex_item(r) for r in REGEXES]
            + [choice_item(c) for c in CHOICES])


def validation_error(text: str, schema: dict) -> str | None:
    """Why `text` is not an instance of `schema` (None: it is)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    try:
        import jsonschema
    except ImportError:
        missing = [k for k in schema.get("required", ()) if not isinstance(value, dict) or k not in value]
        return f"missing required keys {missing}" if missing else None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return exc.message
    return None


def check(answers: list[dict], schema: dict | None = None, validators: list | None = None) -> dict:
    """Counts of how the answers ended and the invalid ones (with the reason): each against `schema`, or
    answer i against validators[i] (text -> error or None)."""
    out = {"num_requests": len(answers), "failed": [a["error"] for a in answers if "error" in a],
           "ended": 0, "valid": 0, "length": 0, "invalid": []}
    for i, a in enumerate(answers):
        if "error" in a:
            continue
        if a["finish_reason"] != "stop":
            out["length"] += 1
            continue
        out["ended"] += 1
        error = validators[i](a["content"]) if validators else validation_error(a["content"], schema)
        if error:
            out["invalid"].append({"content": a["content"][:300], "error": error})
        else:
            out["valid"] += 1
    return out


def compile_latency(ask_one, schema: dict, repeats: int) -> dict:
    """`ask_one(schema)` timed under `repeats` fresh schemas (cold) and each one again (cached), in ms."""
    nonce, cold_ms, cached_ms, errors = os.urandom(4).hex(), [], [], []
    for i in range(repeats):
        fresh = {**schema, "title": f"compile-{nonce}-{i}"}  # a new text: not in the server's grammar cache
        for times in (cold_ms, cached_ms):
            start = time.perf_counter()
            answer = ask_one(fresh)
            times.append((time.perf_counter() - start) * 1000)
            errors += [answer["error"]] if "error" in answer else []
    out = {"cold_ms": cold_ms, "cached_ms": cached_ms, "failed": errors}
    if repeats:
        out.update(median_cold_ms=statistics.median(cold_ms), median_cached_ms=statistics.median(cached_ms),
                   compile_ms_estimate=statistics.median(c - w for c, w in zip(cold_ms, cached_ms)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="default: the first of /v1/models")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--schema", help="JSON schema file")
    group.add_argument("--corpus", action="store_true", help="every constraint of the test corpus, one request each")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--compile-repeats", type=int, default=0, help="cold/cached one-token request pairs")
    p.add_argument("--out", default=None, help="write the counts as JSON here")
    args = p.parse_args(argv)
    api_key = os.environ.get("BLINK_API_KEY") or os.environ.get("OPENAI_API_KEY")
    model = args.model or first_model(args.url, api_key)
    if args.corpus:
        items = corpus()
        with ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda i: ask(args.url, api_key, model, {}, args.max_tokens, i, items[i][0]),
                                    range(len(items))))
        report = check(answers, validators=[v for _, v in items])
        report["corpus"] = True
        print(f"structured corpus: {len(items)} constraints; ", end="")
    else:
        schema = json.loads(Path(args.schema).read_text())
        with ThreadPoolExecutor(min(args.num_requests, 32)) as pool:
            answers = list(pool.map(lambda i: ask(args.url, api_key, model, schema, args.max_tokens, i),
                                    range(args.num_requests)))
        report = check(answers, schema)
    print(f"structured check: {report['valid']} of {report['ended']} ended answers valid, {report['length']} cut "
          f"by max_tokens ({args.max_tokens}), {len(report['failed'])} failed"
          + "".join(f"\n  invalid: {x['error']}: {x['content']!r}" for x in report["invalid"][:5])
          + "".join(f"\n  failed: {x}" for x in report["failed"][:3]), flush=True)
    if args.compile_repeats and not args.corpus:
        report["compile"] = compile_latency(lambda s: ask(args.url, api_key, model, s, 1, 0), schema,
                                            args.compile_repeats)
        c = report["compile"]
        print(f"schema compile: one-token request {c['median_cold_ms']:.1f} ms under a new schema, "
              f"{c['median_cached_ms']:.1f} ms under a cached one: about {c['compile_ms_estimate']:.1f} ms to compile "
              f"(median of {args.compile_repeats})", flush=True)
        report["failed"] += c["failed"]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if report["ended"] and not report["invalid"] and not report["failed"] else 1


def first_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/models", headers=headers), timeout=30) as resp:
        return json.loads(resp.read())["data"][0]["id"]


if __name__ == "__main__":
    sys.exit(main())
