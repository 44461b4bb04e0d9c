"""The layout a newcomer relies on: `ddl/` is what a checkpoint ships, and its imports run one way
(specifications <- fast paths <- dispatch <- model), with no cycle."""

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


def _graph():
    modules = [f[:-3] for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py"]
    return {m: _relative_imports(os.path.join(PACKAGE, f"{m}.py")) for m in modules}


def test_imports_run_one_way_without_a_cycle():
    graph = _graph()
    assert graph["reference"] == set()  # the specifications import nothing from the package
    assert graph["configuration_ddl"] == set()
    for fast_path in ("fused", "cpu_kernels", "triton_kernels"):  # fast paths never reach back to dispatch or model
        assert not graph[fast_path] & {"kernels", "modeling_ddl"}, fast_path
    assert "modeling_ddl" not in graph["kernels"]
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


def test_the_package_is_what_a_checkpoint_ships(tmp_path):
    """Every module of `ddl/` (but `__init__`) travels with a saved model, and nothing else does: the applications
    live in `ddl_tools/`."""
    from ddl import DDLForCausalLM

    DDLForCausalLM(tiny_config()).save_pretrained(tmp_path)
    shipped = {f for f in os.listdir(tmp_path) if f.endswith(".py")}
    assert shipped == {f for f in os.listdir(PACKAGE) if f.endswith(".py") and f != "__init__.py"}
