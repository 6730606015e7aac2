"""Imports run one way, as ``qsinkkv/ops.py`` states: config/layout -> checks -> storage -> ops (quant, decode,
prefill, write, the C and Triton kernels) -> ops.py -> plan -> step -> cache/engine pages -> integrations/eval. Read
from the source (``ast``: every import, also inside a function or under ``TYPE_CHECKING``), so a cycle or an
upward import fails here by name, before it fails as an ImportError on some import order."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "qsinkkv"

# a module's layer: it may import its own layer's modules and lower ones, never a higher one
LAYERS = [
    {"config", "trace", "models", "rope"},
    {"layout", "policy"},
    {"checks", "quant"},
    {"storage", "attention"},
    {"write", "decode", "prefill", "blocks"},
    {"decode_c", "kernels"},
    {"ops"},
    {"plan"},
    {"step"},
    {"cache", "engine_pages"},
    {"paged", "hybrid"},
    {"integrations", "hf", "eval", "__init__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _unit(module: str) -> str:
    """The layer unit of a dotted module inside the package: its first component (a subpackage is one unit)."""
    return module.split(".")[0]


def _imports(path: Path, package_parts: list[str]) -> list[tuple[int, str]]:
    """(line, unit) of every import of a qsinkkv module in ``path`` (relative or absolute)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the file's package
                base = package_parts[:len(package_parts) - node.level]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [target + [a.name] for a in node.names] if not node.module else [target]
            elif (node.module or "").split(".")[0] == "qsinkkv":
                names = [node.module.split(".")] + [node.module.split(".") + [a.name] for a in node.names]
            else:
                continue
            for parts in names:
                if len(parts) > 1 and parts[0] == "qsinkkv" and parts[1] in RANK:
                    found.append((node.lineno, parts[1]))
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "qsinkkv" and len(parts) > 1 and parts[1] in RANK:
                    found.append((node.lineno, parts[1]))
    return found


def _core_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.glob("*.py")) if p.stem != "__init__"]


def test_every_core_module_has_a_layer():
    missing = [p.stem for p in _core_modules() if p.stem not in RANK]
    assert not missing, f"modules with no layer in LAYERS: {missing}"


def test_core_modules_import_only_their_layer_and_below():
    upward = []
    for path in _core_modules():
        mine = RANK[path.stem]
        for line, unit in _imports(path, ["qsinkkv", path.stem]):
            if RANK[unit] > mine:
                upward.append(f"qsinkkv/{path.name}:{line} imports {unit} (layer {RANK[unit]} > {mine})")
    assert not upward, "imports that run the wrong way:\n" + "\n".join(upward)


def test_the_kernels_import_only_below_the_ops():
    upward = []
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for line, unit in _imports(path, ["qsinkkv", "kernels", path.stem]):
            if RANK[unit] > RANK["kernels"]:
                upward.append(f"kernels/{path.name}:{line} imports {unit}")
    assert not upward, "imports that run the wrong way:\n" + "\n".join(upward)


def test_checks_is_a_leaf():
    """The input checks import the config, the layout and the trace only: every op may use them."""
    units = {unit for _, unit in _imports(PACKAGE / "checks.py", ["qsinkkv", "checks"])}
    assert units <= {"config", "layout", "trace"}, units
