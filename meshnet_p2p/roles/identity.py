"""``meshnet-peer identity new|show``: create a key file (0600), or print the
peer ID of one, as JSON."""

from __future__ import annotations

import argparse
import json
import os

from meshnet_p2p.core.identity import Identity, default_identity_path


def run(args: argparse.Namespace) -> int:
    path = args.identity or default_identity_path()
    if args.identity_command == "new":
        ident = Identity.generate()
        ident.save(path, overwrite=args.force)
    else:
        ident = Identity.load(path)
    print(json.dumps({"peer_id": str(ident.peer_id), "path": os.path.abspath(path)}))
    return 0
