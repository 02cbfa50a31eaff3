"""How every bench prints its figures: one JSON object with --json, else aligned lines."""

import json


def print_report(doc: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(doc))
        return
    width = max(map(len, doc)) + 2
    for k, v in doc.items():
        print(f"{k:{width}s} {v}")
