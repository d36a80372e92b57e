"""No import cycles among deep_ep_jax's modules, counting the imports inside
functions too (a cycle hidden in a function is still a cycle), and the xla
backend imports without the CUDA extension."""

import ast
import pathlib
import subprocess
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "deep_ep_jax"


def _modules():
    """{dotted module name: path} of every Python file of the package."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph():
    """{module: {modules it imports}}: `from P import n` is an edge to P.n
    when that is a module of the package, else to P."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def find_cycle(graph):
    """One cycle as [a, b, ..., a], or None."""
    state = {}  # module -> 1 while on the path, 2 when done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [node])
            if cycle:
                return cycle
    return None


def test_graph_sees_the_modules():
    graph = import_graph()
    assert "deep_ep_jax.comm.buffer" in graph["deep_ep_jax"]
    assert "deep_ep_jax.backends.cuda.lifecycle" in graph["deep_ep_jax.comm.buffer"]  # imported inside a function
    assert "deep_ep_jax.backends" in graph["deep_ep_jax.comm.buffer"]  # a name of a package's __init__
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_xla_backend_without_the_extension():
    """A CPU-only install: the public API and the reference backend import and
    run with deep_ep_jax._C unimportable."""
    code = (
        "import sys; sys.modules['deep_ep_jax._C'] = None\n"
        "import jax, jax.numpy as jnp, deep_ep_jax as dej\n"
        "from deep_ep_jax import info, testing\n"
        "mesh = testing.ep_mesh(2, 'ep', platform='cpu')\n"
        "buffer = dej.Buffer(mesh, 'ep')\n"
        "assert buffer.backend == 'xla', buffer\n"
        "idx = jnp.zeros((2 * 4, 2), jnp.int32)\n"
        "f = testing.per_rank(lambda i: dej.get_dispatch_layout(i, num_experts=4, buffer=buffer), mesh, 'ep')\n"
        "jax.block_until_ready(f(idx))\n"
    )
    env_flags = "--xla_force_host_platform_device_count=2"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "XLA_FLAGS": env_flags, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
