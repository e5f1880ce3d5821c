"""The MTP draft vocabulary: count what the model generates, keep the K most frequent ids.

A token outside the draft vocabulary can never be proposed, so every occurrence of one is a
forced rejection; coverage (the share of generated tokens inside the list) is the number that
matters, measured on outputs the list was not chosen from.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

COUNTS_FORMAT = "qwen-serving token counts v1"
DEFAULT_K = 40_000


def top_k_ids(counts: Counter[int], k: int, always: Iterable[int] = ()) -> list[int]:
    """The k most frequent ids (ties: lower id first), always including `always`; sorted ascending."""
    chosen = list(dict.fromkeys(always))
    if len(chosen) > k:
        raise ValueError(f"{len(chosen)} ids must always be included but k is {k}")
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    taken = set(chosen)
    for token, _n in ranked:
        if len(chosen) >= k:
            break
        if token not in taken:
            chosen.append(token)
            taken.add(token)
    return sorted(chosen)


def coverage(ids: Iterable[int], counts: Counter[int]) -> float:
    """Share of the counted tokens whose id is in `ids`."""
    total = sum(counts.values())
    if not total:
        raise ValueError("no tokens counted")
    inside = set(ids)
    return sum(n for token, n in counts.items() if token in inside) / total


def read_counts(paths: Iterable[str | Path]) -> Counter[int]:
    total: Counter[int] = Counter()
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != COUNTS_FORMAT:
            raise ValueError(f"{path} is not a token-count file from prepare/count_outputs.py")
        total.update({int(token): int(n) for token, n in data["counts"].items()})
    return total


def write_counts(path: str | Path, counts: Counter[int], meta: dict) -> None:
    data = {"format": COUNTS_FORMAT, **meta, "total": sum(counts.values()),
            "counts": {str(t): n for t, n in sorted(counts.items())}}
    write_json_atomic(Path(path), data)


def read_id_list(path: str | Path) -> list[int]:
    """A JSON list of ids, or an object with an "ids" list (the file build_draft_vocab writes)."""
    with open(path) as f:
        data = json.load(f)
    ids = data.get("ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: expected a JSON list of token ids (or {{\"ids\": [...]}})")
    return ids


def write_json_atomic(path: Path, data: dict | list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def stop_ids(config: dict, generation_config: dict | None) -> list[int]:
    """End-of-turn ids: the drafter must be able to propose them."""
    ids: list[int] = []
    for source in (generation_config or {}, config.get("text_config") or {}, config):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(v for v in value if isinstance(v, int))
    return list(dict.fromkeys(ids))


def read_prompts(path: str | Path) -> list[dict]:
    """JSONL of {"messages": [...]} (chat) or {"prompt": "..."} (completion); plain lines are prompts."""
    prompts = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            item = line
        if isinstance(item, str):
            item = {"prompt": item}
        if not isinstance(item, dict) or not ("messages" in item or "prompt" in item):
            raise ValueError(f"{path}:{n}: expected {{\"messages\": [...]}} or {{\"prompt\": \"...\"}}")
        prompts.append(item)
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def generated_ids(url: str, item: dict, settings: dict, api_key: str | None, timeout: float) -> list[int]:
    """One request to an OpenAI-compatible vLLM server; the generated token ids."""
    import urllib.request

    chat = "messages" in item
    body = {**settings, **item, "return_token_ids": True}
    request = urllib.request.Request(
        f"{url.rstrip('/')}/{'chat/completions' if chat else 'completions'}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        reply = json.load(response)
    ids = reply["choices"][0].get("token_ids")
    if ids is None:
        raise ValueError("the server returned no token_ids (needs vLLM's return_token_ids, vLLM >= 0.10.2)")
    return [int(i) for i in ids]


def count_outputs(
    url: str, prompts: list[dict], settings: dict, *, api_key: str | None = None, concurrency: int = 8,
    holdout_every: int = 0, timeout: float = 600.0, log=print,
) -> tuple[Counter[int], Counter[int], int]:
    """Send every prompt; count generated ids (every `holdout_every`-th prompt into the held-out
    counter). Returns (counts, held_out, failures)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    counts: Counter[int] = Counter()
    held: Counter[int] = Counter()
    failures = 0
    next_report = 0.1
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        futures = {pool.submit(generated_ids, url, item, settings, api_key, timeout): i for i, item in enumerate(prompts)}
        for done, future in enumerate(as_completed(futures), 1):
            index = futures[future]
            try:
                ids = future.result()
            except Exception as e:  # one bad request must not lose the rest of the run
                failures += 1
                log(f"count_outputs: prompt {index} failed: {e}")
                continue
            is_held = holdout_every > 0 and index % holdout_every == holdout_every - 1
            (held if is_held else counts).update(ids)
            if done / len(prompts) >= next_report:
                log(f"count_outputs: {done}/{len(prompts)} prompts, {sum(counts.values()) + sum(held.values())} tokens")
                next_report += 0.1
    return counts, held, failures
