"""The MTP draft vocabulary: count what the model generates, keep the K most frequent ids.

A token outside the draft vocabulary can never be proposed, so every occurrence of one is a
forced rejection; coverage (the share of generated tokens inside the list) is the number that
matters, measured on outputs the list was not chosen from.

Pure logic only (no HTTP): prepare/count_outputs.py asks the server, through bench/serving.py.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from qwen_serving import files

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


def read_counts(paths: Iterable[str | Path], part: str = "counts") -> Counter[int]:
    """The summed counts of `part` ("counts", or "holdout": the outputs of held-out prompts) of count files; a
    file without a holdout part gives its counts for "holdout" (a count file of held-out outputs only)."""
    total: Counter[int] = Counter()
    for path in paths:
        data = read_count_file(path)
        chosen = data.get(part) if part in data else data["counts"]
        total.update({int(token): int(n) for token, n in chosen.items()})
    return total


def read_count_file(path: str | Path) -> dict:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != COUNTS_FORMAT:
        raise ValueError(f"{path} is not a token-count file from prepare/count_outputs.py")
    return data


def write_counts(path: str | Path, counts: Counter[int], meta: dict, holdout: Counter[int] | None = None) -> None:
    """Counts (and the held-out prompts' counts) with `meta`, written beside and renamed into place."""
    data = {"format": COUNTS_FORMAT, **meta, "total": sum(counts.values()),
            "counts": {str(t): n for t, n in sorted(counts.items())}}
    if holdout is not None:
        data["holdout_total"] = sum(holdout.values())
        data["holdout"] = {str(t): n for t, n in sorted(holdout.items())}
    write_json_atomic(Path(path), data)


def is_held_out(prompt_index: int, every: int) -> bool:
    """Every `every`-th prompt of a set is held out: the list is never chosen from its outputs."""
    return every > 0 and prompt_index % every == every - 1


def expand_prompt_set(data: dict) -> list[dict]:
    """A prompt set from templates (prepare/calibration_prompts.json): each category's templates filled with
    each of their slot's values, the categories interleaved so any prefix of the set is mixed. A template is
    {"text": "... {slot} ...", "slot": NAME} with optional "system" and "tools" (the category's tool list)."""
    per_category = []
    for name, category in data["categories"].items():
        items = []
        for template in category["templates"]:
            values = category["slots"][template["slot"]] if "slot" in template else [""]
            for value in values:
                messages = [{"role": "system", "content": template["system"]}] if "system" in template else []
                messages.append({"role": "user", "content": template["text"].replace("{" + template.get("slot", "") + "}",
                                                                                     value)})
                item = {"messages": messages}
                if template.get("tools"):
                    item["tools"] = [data["tools"][tool] for tool in template["tools"]]
                items.append(item)
        if not items:
            raise ValueError(f"prompt category {name!r} has no prompts")
        per_category.append(items)
    longest = max(len(items) for items in per_category)
    return [items[i] for i in range(longest) for items in per_category if i < len(items)]


def read_id_list(path: str | Path) -> list[int]:
    """A JSON list of ids, or an object with an "ids" list (the file build_draft_vocab writes)."""
    with open(path) as f:
        data = json.load(f)
    ids = data.get("ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{path}: expected a JSON list of token ids (or {{\"ids\": [...]}})")
    return ids


def write_json_atomic(path: Path, data: dict | list) -> None:
    files.write_text_atomic(path, json.dumps(data) + "\n")


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
