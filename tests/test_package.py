"""The layout a newcomer relies on: `ddl/` is what a checkpoint ships, its imports run one way (specifications <-
PyTorch paths <- dispatch <- model) with no cycle, and it never imports the accelerators (`ddl_kernels`) but through
the dispatcher's guarded import."""

import ast
import os

from conftest import ROOT, tiny_config


PACKAGE = os.path.join(ROOT, "ddl")


def _relative_imports(path):
    """The package modules a file imports (relative imports, at any depth of the file)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module] if node.module else [alias.name for alias in node.names])
    return found


def _graph(package=PACKAGE):
    modules = [f[:-3] for f in os.listdir(package) if f.endswith(".py") and f != "__init__.py"]
    return {m: _relative_imports(os.path.join(package, f"{m}.py")) for m in modules}


def _assert_no_cycle(graph):
    done, visiting = set(), []

    def visit(module):
        assert module not in visiting, f"import cycle: {' -> '.join(visiting + [module])}"
        if module in done:
            return
        visiting.append(module)
        for imported in graph.get(module, ()):
            visit(imported)
        visiting.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_imports_run_one_way_without_a_cycle():
    graph = _graph()
    assert graph["reference"] == set()  # the specifications import nothing from the package
    assert graph["configuration_ddl"] == set()
    assert graph["ops"] == {"reference"}  # the dispatcher: the specifications, or a kernel
    assert "modeling_ddl" not in graph["ops"]
    _assert_no_cycle(graph)


def test_the_scripts_helpers_import_one_way_without_a_cycle():
    """`ddl_tools/`, one module per concern, imports one way too (imports inside functions included): the one-line
    error and the folder rule live in `outputs`, which imports none of the others."""
    graph = _graph(os.path.join(ROOT, "ddl_tools"))
    assert graph["outputs"] == set()
    _assert_no_cycle(graph)


def test_the_code_is_licensed_apache_2():
    """The license transformers itself has, in the LICENSE file and the package's metadata (an SPDX expression)."""
    import tomllib

    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        text = f.read()
    assert text.startswith("Copyright 2026 the ddl authors\n") and "Version 2.0, January 2004" in text
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]


def test_the_package_is_what_a_checkpoint_ships(tmp_path):
    """Every module of `ddl/` (but `__init__`) travels with a saved model, and nothing else does: the applications
    live in `ddl_tools/`."""
    from ddl import DDLForCausalLM

    DDLForCausalLM(tiny_config()).save_pretrained(tmp_path)
    shipped = {f for f in os.listdir(tmp_path) if f.endswith(".py")}
    assert shipped == {f for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py"}


def test_the_accelerators_are_imported_only_by_the_dispatcher_and_never_import_the_model():
    """`ddl_kernels` is imported by `ddl.ops` alone, inside a try (so transformers' remote-code import check does
    not require it); its own modules import nothing of the model package, anywhere (a checkpoint's code must get its
    kernels' numbers from the kernels, not from an installed `ddl`)."""
    for name in (f for f in os.listdir(PACKAGE) if f.endswith(".py")):
        tree = ast.parse(open(os.path.join(PACKAGE, name), encoding="utf-8").read())
        tries = [node for node in ast.walk(tree) if isinstance(node, ast.Try)]
        guarded = {id(n) for t in tries for part in t.body for n in ast.walk(part)}
        imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import)
                   and any(alias.name.split(".")[0] == "ddl_kernels" for alias in node.names)]
        assert all(id(node) in guarded for node in imports), name
        assert bool(imports) == (name == "ops.py"), name
    for folder, _, files in os.walk(os.path.join(ROOT, "ddl_kernels")):
        for name in (f for f in files if f.endswith(".py")):
            tree = ast.parse(open(os.path.join(folder, name), encoding="utf-8").read())
            every = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
            modules = [alias.name for node in every if isinstance(node, ast.Import) for alias in node.names]
            modules += [node.module for node in every if isinstance(node, ast.ImportFrom) and node.level == 0]
            assert not any(m == "ddl" or m.startswith("ddl.") for m in modules), (name, modules)
