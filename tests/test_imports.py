"""The import graph DESIGN.md fixes: imports only go downwards between packages, no package
imports another package's private module or name, and no module cycle, lazy or not.

Every import statement of gradcomp's own modules counts, including those inside functions
(a lazy import hides a cycle from the interpreter, not from the design); only imports under
``if TYPE_CHECKING:`` are left out, since they never run."""
import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]

# lower layers first; a package may import its own layer and the layers below it
LAYERS = [{"kernels"}, {"compress"}, {"collectives"}, {"training"}, {"sharded"}, {"memory", "optim"}, {"pipeline"},
          {"bench"}]
LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}
# DESIGN.md: "memory and optim do not import each other's internals (a sharded LAMB uses
# memory's public sharding API)": optim may import memory's public names
SIDEWAYS = {("optim", "memory")}
# names kept importable where users found them before they moved up a layer: (module, target),
# each a lazy import inside the module's __getattr__, loaded only when the name is asked for
KEPT_NAMES = {("gradcomp.training", "gradcomp.sharded")}  # compress_fsdp, FSDPCompression


def _modules() -> Dict[str, Path]:
    out = {}
    for pkg in LEVEL:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out["gradcomp." + ".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``node`` except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for alt in child.orelse:
                yield alt
                yield from _walk(alt)
            continue
        yield child
        yield from _walk(child)


def _resolve(module: str, is_package: bool, level: int, name: str) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[:-(level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str, path: Path) -> Iterator[Tuple[str, List[str], int]]:
    """(imported module, names taken from it, line) for each import of gradcomp's own code."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    is_package = path.name == "__init__.py"
    for node in _walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                if target.split(".")[0] in LEVEL:  # a root folder imported by its top-level name
                    target = "gradcomp." + target
                if target.startswith("gradcomp."):
                    yield target, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module or "") if node.level else (node.module or "")
            if target.split(".")[0] in LEVEL:
                target = "gradcomp." + target
            if not target.startswith("gradcomp."):
                continue
            names = [a.name for a in node.names]
            subs = [n for n in names if f"{target}.{n}" in MODULES]  # `from pkg import submodule`
            for sub in subs:
                yield f"{target}.{sub}", [], node.lineno
            yield target, [n for n in names if n not in subs], node.lineno


def _package(module: str) -> str:
    return module.split(".")[1]


def _edges() -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for target, _, _ in _imports(module, path):
            while target not in MODULES and "." in target:  # `import gradcomp.x.y.name`-style attribute paths
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != module:
                graph[module].add(target)
    return graph


def test_imports_only_go_downwards():
    wrong = []
    for module, path in MODULES.items():
        here = _package(module)
        for target, _, line in _imports(module, path):
            if target == "gradcomp" or _package(target) not in LEVEL:
                continue
            there = _package(target)
            if any(module == m and (target == t or target.startswith(t + ".")) for m, t in KEPT_NAMES):
                continue
            if there != here and LEVEL[there] >= LEVEL[here] and (here, there) not in SIDEWAYS:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target} (a layer at or above {here})")
    assert not wrong, "imports that go up or sideways between layers:\n" + "\n".join(wrong)


def test_no_package_imports_another_packages_private_parts():
    wrong = []
    for module, path in MODULES.items():
        here = _package(module)
        for target, names, line in _imports(module, path):
            if target == "gradcomp" or _package(target) == here:
                continue
            private_mod = [p for p in target.split(".")[2:] if p.startswith("_") and p != "__init__"]
            private_names = [n for n in names if n.startswith("_")]
            if private_mod or private_names:
                what = f"module {target}" if private_mod else f"{', '.join(private_names)} from {target}"
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports the private {what}")
    assert not wrong, ("imports of another package's private module or name (make it public in its own "
                       "package, or move the code):\n" + "\n".join(wrong))


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a list."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_init(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def test_no_import_cycles():
    graph = _edges()
    # a package's __init__ re-exports its modules; a module importing its own package's names
    # from __init__ is the usual cycle of a package, not a design one: only module-to-module counts
    graph = {m: {t for t in ts if not _is_package_init(t)} for m, ts in graph.items() if not _is_package_init(m)}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (lazy imports included):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_walker_sees_what_it_must():
    # guards the test itself: a lazy import inside a function and a relative import are edges
    graph = _edges()
    assert "gradcomp.compress.payload" in graph["gradcomp.compress.base"], "the walker missed a relative import"
    assert any(t.startswith("gradcomp.collectives") for t in graph["gradcomp.training.engine"])
    src = "def f():\n    from .x import _y\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) for n in _walk(tree))
    guarded = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import y\n"
    assert not [n for n in _walk(ast.parse(guarded)) if isinstance(n, ast.ImportFrom) and n.module == "x"]


def test_tools_scripts_use_gradcomp_from_outside():
    """tools/ holds scripts outside the package (the GPU check, one-off measurements): they import
    only gradcomp's public modules and names, as a user's script would, and no module of gradcomp
    imports one of them."""
    scripts = {p.stem: p for p in sorted((ROOT / "tools").glob("*.py"))}
    assert "gpu_check" in scripts
    wrong = []
    for stem, path in scripts.items():
        for target, names, line in _imports(f"tools.{stem}", path):
            private = [p for p in target.split(".")[1:] if p.startswith("_")] + [n for n in names if n.startswith("_")]
            if private:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports the private {', '.join(private)} of {target}")
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in _walk(tree):
            found = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno} imports tools/{n}.py" for n in found
                      if n.split(".")[0] in scripts or n.split(".")[0] == "tools"]
    assert not wrong, "\n".join(wrong)


def test_moved_names_stay_importable_where_users_found_them():
    """Sharded data parallelism lives in gradcomp.sharded; the names DESIGN.md lists under
    gradcomp.memory, and compress_fsdp under gradcomp.training, are the same objects there."""
    import gradcomp.memory as memory
    import gradcomp.sharded as sharded
    import gradcomp.training as training
    for name in ("ShardedOptimizer", "LowBitState", "state_nbytes"):
        assert getattr(memory, name) is getattr(sharded, name), name
    from gradcomp.training import FSDPCompression, compress_fsdp
    assert compress_fsdp is sharded.compress_fsdp and FSDPCompression is sharded.FSDPCompression
    assert "compress_fsdp" in training.__all__


# ---- state that flows without being passed -----------------------------------------------
# Every ``contextvars.ContextVar`` and ``threading.local`` in gradcomp, with the reason it may
# exist. Each is private to its module (read and set through that module's functions) and none
# may be added without a line here: state a reader cannot see in a call's arguments is the
# hardest to follow. The transaction's is the one that crosses packages (opened by the layers
# that step, joined by the compressors' state changes through ``transaction.current()``).
AMBIENT = {
    ("compress/transaction.py", "_current"): "the open state transaction, joined by compressors' state changes "
                                             "(crosses packages: compress.Compressor.compress cannot take one)",
    ("compress/transaction.py", "_deferred"): "refusals deferred to the transaction's one read, same module only",
    ("compress/sparse.py", "_bounds"): "the agreed payload bounds of the exchange in progress, same package only",
    ("collectives/_comm.py", "_thread"): "the device a worker thread's communicator uses, same package only",
}


def _ambient_sites() -> Set[Tuple[str, str]]:
    found = set()
    for path in MODULES.values():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call):
                fn = node.value.func
                owner = fn.value.id if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) else ""
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if (owner, name) in (("contextvars", "ContextVar"), ("threading", "local"), ("", "ContextVar")):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if isinstance(t, ast.Name):
                            found.add((path.relative_to(ROOT).as_posix(), t.id))
    return found


def test_ambient_state_is_listed_and_private():
    sites = _ambient_sites()
    assert sites == set(AMBIENT), (f"context variables / thread-locals not listed in AMBIENT: {sorted(sites - set(AMBIENT))}; "
                                   f"listed but gone: {sorted(set(AMBIENT) - sites)}")
    assert all(name.startswith("_") for _, name in sites)
    # none is imported by name anywhere else (their modules' functions are the only way in)
    for module, path in MODULES.items():
        for target, names, line in _imports(module, path):
            for file, name in AMBIENT:
                assert name not in names or not target.endswith(Path(file).stem), \
                    f"{path.relative_to(ROOT)}:{line} imports {name} from {target}"
