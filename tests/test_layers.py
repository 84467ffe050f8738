"""Module boundaries: the packages built on timely use only its public modules, and timely's own
layers import one way (worker -> dataflow -> operators -> capabilities -> progress; communication
apart). Imports are read from the source (module level, outside ``if TYPE_CHECKING:``)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: What code outside the engine may import from it.
PUBLIC = {"timely", "timely.routing", "timely.errors", "timely.testing", "timely.collector", "timely.launch",
          "timely.comm.secret",  # the job secret: the bridge and Megaphone's endpoint secure their sockets with it
          "timely.columnar",  # streams of Arrow record batches
          "timely.checkpoint"}  # checkpoints: participants (Megaphone's bins), replayable sources, sinks
CLIENTS = ["megaphone", "spark_bridge", "nexmark", "pyspark_timely", "examples"]


def runtime_imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports when it is loaded (``from timely import x``
    counts as ``timely.x`` when ``x`` is a submodule)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    if path.name == "__init__.py":
        package = ".".join(path.relative_to(ROOT).parts[:-1])
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue  # annotations only
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                found.add(module)
                for a in node.names:
                    if (ROOT / Path(*module.split("."), a.name)).with_suffix(".py").exists() or \
                            (ROOT / Path(*module.split("."), a.name, "__init__.py")).exists():
                        found.add(f"{module}.{a.name}")
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)

    visit(tree.body)
    return found


def files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", CLIENTS)
def test_clients_import_only_the_public_engine(package):
    bad = {
        (str(f.relative_to(ROOT)), m)
        for f in files(package)
        for m in runtime_imports(f)
        if (m == "timely" or m.startswith("timely.")) and m not in PUBLIC
    }
    assert not bad, f"private engine modules imported: {sorted(bad)}"


# Within timely: the layers each module may import (besides its own package and timely.errors).
LAYERS = {
    "timely.progress": set(),
    "timely.comm": set(),
    "timely.dataflow": {"timely.progress", "timely.routing"},
    # Columnar streams: operators over the dataflow layer, buffers over the transport's framing.
    "timely.columnar": {"timely.dataflow", "timely.progress", "timely.routing", "timely._native", "timely.comm.framing"},
    # Checkpoints: storage below everything, sources and sinks over the public dataflow API.
    "timely.checkpoint": {"timely.dataflow", "timely.routing"},
}
# Within timely.dataflow: a module imports only modules of a lower rank.
DATAFLOW_RANK = {
    "fuzz": 0, "context": 1, "capability": 1, "channels": 1, "operator": 2, "handles": 3, "input": 3, "keyed": 4,
    "builder": 4, "scope": 5, "dataflow": 5, "__init__": 6,
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_engine_layers_import_one_way(layer):
    allowed = {layer, "timely.errors", *LAYERS[layer]}
    bad = set()
    for f in files(layer.replace(".", "/")):
        for m in runtime_imports(f):
            if m.startswith("timely.") and not any(m == a or m.startswith(a + ".") for a in allowed):
                bad.add((str(f.relative_to(ROOT)), m))
    assert not bad, f"{layer} imports layers above it: {sorted(bad)}"


def test_dataflow_modules_import_downwards():
    bad = []
    for f in files("timely/dataflow"):
        rank = DATAFLOW_RANK[f.stem]
        for m in runtime_imports(f):
            if m.startswith("timely.dataflow."):
                other = m.split(".")[2]
                if DATAFLOW_RANK[other] >= rank:
                    bad.append((f.stem, other))
    assert not bad, f"timely.dataflow modules importing sideways or upwards: {bad}"


def test_the_import_scanner_sees_private_imports(tmp_path, monkeypatch):
    """The check above can fail: a client module importing a private engine module is caught."""
    pkg = ROOT / "examples"
    probe = pkg / "_layer_probe_tmp.py"
    probe.write_text("from timely.dataflow import scope\nimport timely.comm.framing\nfrom timely import routing\n")
    try:
        found = runtime_imports(probe)
    finally:
        probe.unlink()
    assert {"timely.dataflow", "timely.dataflow.scope", "timely.comm.framing", "timely.routing"} <= found
    assert not {"timely.dataflow", "timely.comm.framing"} <= PUBLIC
