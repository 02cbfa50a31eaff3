"""Each layer of meshnet_p2p imports only the layers below it (README's layout table)."""
import ast
import pathlib

import meshnet_p2p

ROOT = pathlib.Path(meshnet_p2p.__file__).parent

# lowest first; a module may import its own layer and any layer with a smaller rank
LAYERS = {
    "core": 0,
    "engine": 1,
    "dht": 2,
    "trust": 3,
    "swarm": 4,
    "dataplane.transport": 5,
    "dataplane": 6,
    "nat": 7,
    "route": 8,
    "verify": 9,
    "client": 10,
    "roles": 11,
    "sim": 12,  # the simulator drives the roles' code on a simulated network (issue 30)
}
# the generated protobuf modules belong to the data plane above its transport
PRIVATE = {"_proto": {"dataplane"}}


def layer_of(module: str) -> str | None:
    """meshnet_p2p.dataplane.transport.tls -> 'dataplane.transport'; top-level modules have none."""
    parts = module.split(".")[1:]
    for n in (2, 1):
        if ".".join(parts[:n]) in LAYERS and len(parts) > n - 1:
            return ".".join(parts[:n])
    return None


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, module: str) -> list[tuple[int, str]]:
    """Absolute names of every meshnet_p2p module or package a file imports (anywhere, lazily or not)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("meshnet_p2p")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.startswith("meshnet_p2p"):
                # "from pkg import module" imports that module
                found += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return found


def violations() -> list[str]:
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        if "._proto" in module:
            continue
        mine = layer_of(module)
        for line, target in imports_of(path, module):
            theirs = layer_of(target)
            where = f"{path.relative_to(ROOT.parent)}:{line} imports {target}"
            private = target.split(".")[1] if target.count(".") >= 1 else ""
            if private in PRIVATE:
                if mine not in PRIVATE[private]:
                    bad.append(f"{where}: only {sorted(PRIVATE[private])} may")
                continue
            if mine is None or theirs is None:
                continue  # the package root, __main__ and testing sit above every layer
            if LAYERS[theirs] > LAYERS[mine]:
                bad.append(f"{where}: {mine} is below {theirs}")
    return bad


def test_no_layer_imports_one_above_it():
    assert violations() == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The check is not vacuous: the layer table names every subpackage, and an upward import is caught."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name != "_proto"}
    assert packages == {name.split(".")[0] for name in LAYERS}
    source = "from ..roles import cli\nfrom meshnet_p2p.client import Client\nfrom . import errors\n"
    tree_path = tmp_path / "probe.py"
    tree_path.write_text(source)
    targets = [t for _, t in imports_of(tree_path, "meshnet_p2p.core.probe")]
    assert targets == ["meshnet_p2p.roles.cli", "meshnet_p2p.client.Client", "meshnet_p2p.core.errors"]
    assert [LAYERS[layer_of(t)] > LAYERS["core"] for t in targets] == [True, True, False]
