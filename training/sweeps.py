"""Resumable sweeps of greedy answers under compression policies, shared by `kvjax ruler` and `kvjax
longbench`: every (task, length, policy, sample) cell answered through the policy's cache (the policies
that compress right after the prefill share one observed prefill per sample), scored by the benchmark's
own metric and appended to a JSONL file as soon as it is done, so an interrupted sweep resumes where it
stopped and a finished cell is never computed again. Then the per-cell averages with 95% Wilson
intervals, as CSV, JSON, a markdown table and kvpress-style figures."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import jax
import numpy as np

from kvjax import DecodingConfig, Generator
from kvjax.compress import parse_policy
from kvjax.errors import ConfigError
from kvjax.generate import answer_room, prefill_shared, shareable
from kvjax.interrupt import Interrupted
from kvjax.mappings import release_if_crowded
from kvjax.report import plural
from kvjax.training.compression_eval import has_budget, stored_bytes_per_token, with_budget

FULL = "full"  # the policy column of the uncompressed reference
DODGE = 0.004  # leaderboard x offset between methods: their intervals at one ratio side by side


@dataclasses.dataclass(frozen=True)
class Run:
    """One policy of the sweep: its text (None: the full cache), the `--policy` entry it came from and
    the compression ratio it was asked at (kvpress's: the fraction of tokens removed; None: a whole
    policy run as given)."""

    policy: str | None
    method: str
    ratio: float | None

    @property
    def name(self) -> str:
        return self.policy or FULL


def runs(entries: list[str], ratios: list[float]) -> list[Run]:
    """The full cache, then each method at every ratio (`snapkv` -> snapkv:0.75 at ratio 0.75, a
    policy's budget below 1 being the same fraction removed) and each whole policy (`kivi:2`,
    `snapkv:0.5+kivi:4`) as given."""
    out = [Run(None, FULL, 0.0)]
    for entry in entries:  # the entry names its line in the figure: snapkv:allocator=pyramid is not snapkv
        if has_budget(entry):
            out.append(Run(entry, entry, None))
        else:
            out += [Run(with_budget(entry, r), entry, r) for r in ratios]
    return out


@dataclasses.dataclass(frozen=True)
class Item:
    """One input of a sweep: its task and index, the length it runs at (a column of the tables; the
    Generators' capacity unless `capacity` says otherwise), its context and question token ids (no
    question: the whole input compressed at once; else the context alone and the question fed after it,
    `Generator.answer`), the tokens it may generate, and the fields its record gets for an answer
    (`score(answer)`: at least `score`, in [0, 1])."""

    task: str
    length: int
    index: int
    context: list[int]
    question: list[int]
    max_new_tokens: int
    score: Callable[[str], dict]
    capacity: int | None = None


def check_results(results: Path, ident: dict) -> None:
    """Refuse a results file holding cells of another sweep (any field of `ident` but `generator`
    differs: model, weights, seed, haystack, template, question mode...), naming each difference; cells
    of an older generator are not refused: the sweep recomputes those whose input changed."""
    for record in finished(results).values():
        differ = {k: record.get(k) for k in ident if k != "generator" and record.get(k) != ident[k]}
        if differ:
            shown = ", ".join(f"{k} {v!r} there, {ident[k]!r} now" for k, v in differ.items())
            raise ConfigError(
                f"{results} holds the cells of another sweep ({shown}); write this one to another directory "
                "(--out), or delete that file to start over"
            )


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the items of one capacity share, so that they share every compiled program: questions padded
    to `width` tokens, caches leaving `room` slots after their context (that width and the most new
    tokens any item asks), Generators of `capacity` slots (every context with that room)."""

    width: int
    room: int
    capacity: int

    @classmethod
    def of(cls, items: list[Item]) -> Shapes:
        width = max((answer_room(len(i.question), 0) for i in items if i.question), default=0)
        room = width + max(i.max_new_tokens for i in items)
        capacity = max(max(len(i.context) + room, i.capacity or i.length) for i in items)
        return cls(width, room, -(-capacity // 16) * 16)


@dataclasses.dataclass(frozen=True)
class Sweep:
    """A sweep's cells (read back or computed now), how many were computed now, and how many of those
    replaced a stored cell whose input had changed (a generator fixed since)."""

    records: list[dict]
    computed: int
    stale: int


def sweep(
    model,
    tokenizer,
    items: Iterable[Item],
    runs_: list[Run],
    results: Path,
    ident: dict,
    *,
    calibration=None,
    share: bool = True,
    on_cell: Callable[[dict], None] | None = None,
    stop: threading.Event | None = None,
) -> Sweep:
    """Every cell's record, read back from `results` (a JSONL file) or computed and appended to it, with
    the sweep's identity `ident` (a file of another sweep is refused before any compute, `check_results`).
    A stored cell is reused only if its input (a digest of the prompt's tokens) is the one given now.
    Items of one capacity run in a row, sharing their Generators and, padded alike (`Shapes`), every compiled
    program (a sweep that compiled per question length dropped its programs every few samples near
    Linux's limit on memory mappings, `kvjax.mappings`); with `share`, the policies that compress
    once after the prefill (every scorer, allocator and quantizer) compress one observed prefill per item
    (`prefill_shared`) instead of each its own. `on_cell` sees every record, read or computed; a set
    `stop` (Ctrl-C) ends the sweep after the item in progress with `Interrupted`."""
    check_results(results, ident)
    done = finished(results)
    records, computed, stale = [], 0, 0
    gens: dict[str, Generator] = {}
    items = list(items)
    groups: dict[int, list[Item]] = {}
    for item in items:
        groups.setdefault(item.capacity or item.length, []).append(item)
    shapes = {size: Shapes.of(group) for size, group in groups.items()}
    shape = None

    def generator(run: Run) -> Generator:
        if run.name not in gens:
            policy = parse_policy(run.policy) if run.policy else None
            gens[run.name] = Generator(model, capacity=shape.capacity, policy=policy, calibration=calibration)
        return gens[run.name]

    def seen(record: dict) -> None:
        records.append(record)
        if on_cell is not None:
            on_cell(record)

    results.parent.mkdir(parents=True, exist_ok=True)
    try:
        with results.open("a") as log:
            for item in items:
                if shapes[item.capacity or item.length] != shape:
                    gens.clear()  # the last capacity's programs are not needed again
                    shape = shapes[item.capacity or item.length]
                prompt = item.context + item.question
                digest = _digest(prompt)
                kept = {}
                for run in runs_:
                    old = done.get((item.task, item.length, run.name, item.index))
                    if old is not None and old.get("input") == digest:
                        kept[run.name] = old
                    stale += old is not None and run.name not in kept
                for record in kept.values():
                    seen(record)
                pending = [run for run in runs_ if run.name not in kept]
                release_if_crowded()  # hours of compiles would exhaust the process's memory mappings
                for run, answer in answers(pending, generator, item, tokenizer, share, shape).items():
                    policy = parse_policy(run.policy) if run.policy else None
                    record = {
                        "task": item.task,
                        "length": item.length,
                        "policy": run.name,
                        "method": run.method,
                        "ratio": run.ratio,
                        "index": item.index,
                        "answer": answer,
                        **item.score(answer),
                        "bytes_per_token": stored_bytes_per_token(model, policy, len(prompt)),
                        **ident,
                        "input": digest,
                    }
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    computed += 1
                    seen(record)
                if stop is not None and stop.is_set():
                    raise Interrupted(f"stopped after {computed} new cells; every finished cell is in {results}")
    finally:
        _compact(results)
    return Sweep(records, computed, stale)


def _digest(prompt: list[int]) -> str:
    """A cell's input: the first 16 hex digits of the SHA-256 of its prompt's token ids."""
    return hashlib.sha256(np.asarray(prompt, np.int64).tobytes()).hexdigest()[:16]


def _compact(results: Path) -> None:
    """Rewrite `results` with one line per cell (the last written) once recomputed cells have superseded
    others, atomically."""
    if not results.is_file():
        return
    lines = results.read_text().splitlines()
    latest = finished(results)
    if len(latest) == len(lines):
        return
    tmp = results.with_name(f".{results.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in latest.values()))
    os.replace(tmp, results)


def answers(pending: list[Run], generator, item: Item, tokenizer, share: bool, shape: Shapes) -> dict:
    """Each pending run's greedy answer (text) to the item: its context prefilled (and compressed, leaving
    the `shape`'s room), then, when a question is given apart, the question fed through that cache
    (`Generator.answer`). A model that ends its text (EOS) stops there, as Hugging Face's generate does."""
    if not pending:
        return {}
    context, question = item.context, item.question
    decoding = DecodingConfig(max_new_tokens=item.max_new_tokens, eos_id=tokenizer.eos_id)
    shared = [run for run in pending if share and (run.policy is None or shareable(generator(run)))]
    key, outs = jax.random.key(decoding.seed), {}
    room = shape.room
    tokens, lengths = generator(pending[0]).pad([context], room)

    def finish(g: Generator, prefilled: tuple):
        if question:
            return g.answer([context], [question], decoding, rng=key, prefilled=prefilled, width=shape.width)
        return g.decode(prefilled[1], prefilled[0], lengths, decoding, key, prefilled[2])

    if len(shared) > 1:
        for run, prefilled in zip(shared, prefill_shared([generator(r) for r in shared], tokens, lengths, room)):
            outs[run.name] = finish(generator(run), prefilled)
    out = {}
    for run in pending:
        g = generator(run)
        if run.name not in outs and shareable(g):  # caches sized for the bucket: samples share compiles
            outs[run.name] = finish(g, g.prefill_compressed(tokens, lengths, room, sized_for=tokens.shape[1]))
        if run.name not in outs:
            outs[run.name] = (
                g.answer([context], [question], decoding, width=shape.width) if question else g([context], decoding)
            )
        result = outs[run.name]
        ids = np.asarray(result.tokens[0, : result.lengths[0]]).tolist()
        out[run] = tokenizer.decode(ids[:-1] if ids and ids[-1] == tokenizer.eos_id else ids)
    return out


def finished(results: Path) -> dict[tuple, dict]:
    """The cells a sweep's JSONL file holds, by (task, length, policy, sample index), the last written of
    each. A line cut short by an interrupted write is the last one, and is computed again."""
    done = {}
    if results.is_file():
        for line in results.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[_key(record)] = record
    return done


def _key(record: dict) -> tuple:
    return record["task"], record["length"], record["policy"], record["index"]


# --------------------------------------------------------------------------------------------------
# Tables and figures


def summarize(records: list[dict]) -> list[dict]:
    """One row per (policy, task, length): the mean score in percent, the samples, their standard
    deviation (over the samples, ddof 0), the 95% Wilson interval of the mean (`wilson`) and the policy's
    cache bytes per token."""
    cells: dict[tuple, list[dict]] = {}
    for r in records:
        cells.setdefault((r["policy"], r["task"], r["length"]), []).append(r)
    rows = []
    for (policy, task, length), group in cells.items():
        scores = 100 * np.array([r["score"] for r in group])
        low, high = wilson(scores.mean() / 100, len(scores))
        first = group[0]
        rows.append(
            dict(
                policy=policy,
                method=first["method"],
                ratio=first["ratio"],
                query_aware=first.get("query_aware"),
                haystack=first.get("haystack"),
                task=task,
                length=length,
                samples=len(group),
                score=float(scores.mean()),
                std=float(scores.std()),
                ci95_low=100 * low,
                ci95_high=100 * high,
                bytes_per_token=float(np.mean([r["bytes_per_token"] for r in group])),
            )
        )
    return rows


def wilson(mean: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% for z = 1.96) of a mean score in [0, 1] over n answers. Exact-match
    answers score 0 or 1; a partly right one (RULER's `all` metric) has at most the variance of a 0/1
    answer of the same mean, so for those the interval errs wide. It exists for n = 1 and never claims
    certainty: 2 right answers of 2 give (34%, 100%), not 100 +- 0."""
    centre, spread = mean + z * z / (2 * n), z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n))
    scale = 1 + z * z / n
    # the interval holds the mean; min/max only keep rounding (1 - 1e-16 at a mean of 1) from saying otherwise
    return max(0.0, min(mean, (centre - spread) / scale)), min(1.0, max(mean, (centre + spread) / scale))


def write_outputs(rows: list[dict], out: Path, title: str) -> list[Path]:
    """results.csv, results.json, results.md, leaderboard.png and tasks.png under `out`."""
    import csv

    out.mkdir(parents=True, exist_ok=True)
    fields = list(rows[0])
    with (out / "results.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    (out / "results.md").write_text(markdown(rows, title))
    _figures(rows, out, title)
    return [out / name for name in ("results.csv", "results.json", "results.md", "leaderboard.png", "tasks.png")]


def average(cells: list[dict]) -> tuple[float, float, float]:
    """(the mean of the cells' scores, the low and high ends of its 95% Wilson interval), in percent: the
    interval counts every (task, sample) answer as one draw, so it exists with one sample per task."""
    means = np.array([c["score"] for c in cells])
    low, high = wilson(float(means.mean()) / 100, int(sum(c["samples"] for c in cells)))
    return float(means.mean()), 100 * low, 100 * high


def shown(mean: float, low: float, high: float) -> str:
    """'39.4 (22.0-58.3)': a mean with its interval."""
    return f"{mean:.1f} ({low:.1f}-{high:.1f})"


def markdown(rows: list[dict], title: str) -> str:
    """Per length, one row per policy: each task's score and the average over tasks with its 95% interval
    (`average`)."""
    from kvjax.report import format_table

    lines = [f"# {title}", ""]
    for length in sorted({r["length"] for r in rows}):
        at = [r for r in rows if r["length"] == length]
        tasks = sorted({r["task"] for r in at})
        body = []
        for policy in dict.fromkeys(r["policy"] for r in at):
            cell = {r["task"]: r for r in at if r["policy"] == policy}
            per_task = [f"{cell[t]['score']:.1f}" if t in cell else "" for t in tasks]
            bytes_ = f"{next(iter(cell.values()))['bytes_per_token']:,.0f}"
            body.append([policy, bytes_, *per_task, shown(*average(list(cell.values())))])
        samples = sorted({r["samples"] for r in at})
        lines += [f"## {length} tokens ({'/'.join(map(str, samples))} {plural(samples[-1], 'sample')} per cell)", ""]
        lines += [format_table(["policy", "B/token", *tasks, "average (95% interval)"], body), ""]
    return "\n".join(lines)


def _figures(rows: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in rows})
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4), squeeze=False, sharey=True)
    for ax, length in zip(axes[0], lengths):
        _leaderboard(ax, [r for r in rows if r["length"] == length])
        ax.set_title(f"{title}, {length} tokens")
    axes[0][0].set_ylabel("average score (%)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.savefig(out / "leaderboard.png", dpi=120, bbox_inches="tight")
    plt.close(fig)

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    tasks = sorted({r["task"] for r in rows})
    fig, axes = plt.subplots(
        1, len(lengths), figsize=(1.5 + 0.6 * len(tasks) * len(lengths), 1 + 0.35 * len(policies)), squeeze=False
    )
    for ax, length in zip(axes[0], lengths):
        score = {(r["policy"], r["task"]): r["score"] for r in rows if r["length"] == length}
        grid = np.array([[score.get((p, t), np.nan) for t in tasks] for p in policies])
        image = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(tasks)), tasks, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(policies)), policies if ax is axes[0][0] else [], fontsize=7)
        ax.set_title(f"{title}, {length} tokens", fontsize=8)
    fig.colorbar(image, ax=axes[0].tolist(), label="score (%)")
    fig.savefig(out / "tasks.png", dpi=120, bbox_inches="tight")
    plt.close(fig)


def _leaderboard(ax, rows: list[dict]) -> None:
    """kvpress's leaderboard for one length: each method's average score (with its 95% interval) against
    the compression ratio, the full cache as a dashed line; a whole policy (kivi:2) is one square at the
    fraction of the full cache's bytes it saves. Methods are drawn a little apart along x (`DODGE`) so that
    intervals at the same ratio stay readable."""
    by: dict[tuple, list[dict]] = {}
    for r in rows:
        by.setdefault((r["method"], r["ratio"]), []).append(r)
    if full := next((v for (m, _), v in by.items() if m == FULL), None):
        ax.axhline(average(full)[0], color="black", linestyle="--", label="full cache")
    full_bytes = full[0]["bytes_per_token"] if full else None
    methods = sorted({m for m, _ in by if m != FULL})
    for i, method in enumerate(methods):
        dodge = DODGE * (i - (len(methods) - 1) / 2)
        cells = {ratio: v for (m, ratio), v in by.items() if m == method}
        if ratios := sorted(r for r in cells if r is not None):
            x, points, mark = ratios, [average(cells[r]) for r in ratios], "o"
        elif full_bytes:
            (v,) = cells.values()
            x, points, mark = [1 - v[0]["bytes_per_token"] / full_bytes], [average(v)], "s"
        else:
            continue
        means, lows, highs = map(np.asarray, zip(*points))
        x = np.asarray(x) + dodge
        ax.errorbar(x, means, yerr=[means - lows, highs - means], marker=mark, capsize=3, label=method)
    ax.set(xlabel="compression ratio (fraction of tokens removed; squares: of bytes)")
    ax.set_ylim(-2, 102)
