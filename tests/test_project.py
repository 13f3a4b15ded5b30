"""The project around the code: the reference build's flags and the user docs."""
import platform
import re
import shutil
import subprocess

import pytest

from conftest import ROOT


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("gcc") is None, reason="x86-64 gcc flags")
def test_the_reference_build_leaves_amx_out_on_cpus_that_have_it():
    """tests/llama_ref/build.sh builds natively; on an AMX CPU ggml's AMX code crashes, so its
    flags must take AMX out even where -march turns it on (Sapphire Rapids' set stands in for
    such a host's -march=native), and leave AVX-512 VNNI in."""
    flags = subprocess.run(["bash", str(ROOT / "tests/llama_ref/build.sh"), "--cflags"], capture_output=True,
                           text=True, check=True).stdout.split()
    for order in (["-march=sapphirerapids", *flags], [*flags, "-march=sapphirerapids"]):
        macros = subprocess.run(["gcc", *order, "-dM", "-E", "-"], input="", capture_output=True, text=True,
                                check=True).stdout
        assert "__AVX512VNNI__" in macros
        assert not re.findall(r"__AMX_\w+__", macros), order


CHRONOLOGY = re.compile(r"\b(this|last|earlier|previous) (session|round)\b|\b(session|round) \d+\b"
                        r"|\bthe (final|last) code\b|\bthe last code change\b", re.I)


def test_user_docs_date_figures_rather_than_tell_the_story():
    """README and docs/ state facts with their date and machine; how they were reached belongs
    in commit messages."""
    found = [f"{path.name}:{n}: {line.strip()}" for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
             for n, line in enumerate(path.read_text().splitlines(), 1) if CHRONOLOGY.search(line)]
    assert not found, "\n".join(found)


ABOVE_THE_ENGINE = ("minillm.cli", "minillm.serving", "minillm.quality")
# the library's front door builds a scheduler on request, importing it then (docs/design.md)
FRONT_DOOR = {("minillm.model", "Model.scheduler"), ("minillm.model", "Model.generate_batch"),
              ("minillm", "__getattr__")}


def _imports(path, module: str):
    """(enclosing function's qualified name, absolute module) of every import in a file."""
    import ast

    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scope + [child.name])
                continue
            if isinstance(child, ast.Import):
                found.extend((".".join(scope), alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - child.level + 1] if child.level else []
                target = ".".join(base + ([child.module] if child.module else []))
                names = [target] if child.module else [f"{target}.{alias.name}" for alias in child.names]
                found.extend((".".join(scope), name) for name in names)
            visit(child, scope)

    visit(ast.parse(path.read_text()), [])
    return found


def test_the_engine_imports_nothing_from_the_layers_above_it():
    """The engine (minillm/ outside cli/, serving/ and quality/) never imports those folders,
    but for the library's front door: Model.scheduler and Model.generate_batch."""
    bad = []
    for path in sorted((ROOT / "minillm").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module.startswith(ABOVE_THE_ENGINE) or module == "minillm.__main__":
            continue
        for scope, target in _imports(path, module):
            if target.startswith(ABOVE_THE_ENGINE) and (module, scope) not in FRONT_DOOR:
                bad.append(f"{module} ({scope or 'module level'}) imports {target}")
    assert not bad, "\n".join(bad)


def _modules(folder, package: str):
    """(module name, path) of every Python file under folder, which installs as package."""
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        yield ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts))).rstrip("."), path


def test_the_tools_below_the_command_line_import_nothing_of_it():
    """quality/ and serving/ are used by the commands, never the other way round: what both need
    (timing a decode, for one) lives below them."""
    bad = [f"{module} ({scope or 'module level'}) imports {target}"
           for layer in ("quality", "serving") for module, path in _modules(ROOT / "minillm" / layer, f"minillm.{layer}")
           for scope, target in _imports(path, module) if target.startswith("minillm.cli")]
    assert not bad, "\n".join(bad)


def test_the_kernels_import_nothing_of_the_package_above_them():
    """kernels/ (installed as minillm.kernels) is the leaf everything uses: it imports only the
    standard library, NumPy, Numba, llvmlite and its own modules."""
    bad = [f"{module} ({scope or 'module level'}) imports {target}"
           for module, path in _modules(ROOT / "kernels", "minillm.kernels")
           for scope, target in _imports(path, module)
           if target.split(".")[0] == "minillm" and not target.startswith("minillm.kernels")]
    assert not bad, "\n".join(bad)


def test_the_command_modules_import_no_circle():
    """cli/app.py assembles the commands; the commands share options and the model's start
    through modules of their own, and no module of cli/ reaches back to one that imports it."""
    graph = {module: {target for _, target in _imports(path, module) if target.startswith("minillm.cli.")}
             for module, path in _modules(ROOT / "minillm" / "cli", "minillm.cli")}
    graph = {module: {t if t in graph else t.rpartition(".")[0] for t in targets} & set(graph)
             for module, targets in graph.items()}

    def reaches(start, goal, seen):
        return any(t == goal or (t not in seen and not seen.add(t) and reaches(t, goal, seen)) for t in graph[start])

    circles = sorted(module for module in graph if reaches(module, module, set()))
    assert not circles, f"modules on an import circle: {circles}"


def test_the_files_conftest_hands_to_the_workers_first_exist():
    """conftest hands FIRST_FILES to the workers first: a renamed file would quietly go back to
    xdist's own place in the order."""
    from conftest import FIRST_FILES, ROOT

    assert all((ROOT / "tests" / name).is_file() for name in FIRST_FILES)
