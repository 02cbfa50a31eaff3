"""How every bench prints its figures: one JSON object with --json, else aligned
lines (a nested object, such as one row per batch size or delay, as a titled section)."""

import json


def print_report(doc: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(doc))
        return
    flat = {k: v for k, v in doc.items() if not isinstance(v, dict)}
    if flat:
        width = max(map(len, flat)) + 2
        for k, v in flat.items():
            print(f"{k:{width}s} {v}")
    for k, v in doc.items():
        if isinstance(v, dict):
            print(k)
            print_report(v, False)
