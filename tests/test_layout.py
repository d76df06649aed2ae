"""The package stays readable: no module over 450 lines, no function over 100 (Triton kernel bodies excepted),
one module decides where a run starts from."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sparsetrain"
MAX_FILE_LINES, MAX_FUNCTION_LINES = 450, 100


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _is_kernel(node: ast.AST) -> bool:
    return any("jit" in ast.unparse(d) for d in getattr(node, "decorator_list", []))


def test_no_module_is_too_long_to_hold_in_the_head():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := p.read_text().count("\n")) > MAX_FILE_LINES}
    assert not long, f"modules over {MAX_FILE_LINES} lines: {long}"


def test_no_function_is_too_long_to_read_at_once():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}::{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_checker_sees_a_long_function():
    body = "\n".join(f"    x = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    tree = ast.parse(f"def f():\n{body}\n")
    node = tree.body[0]
    assert node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES and not _is_kernel(node)
    kernel = ast.parse("@triton.jit\ndef k():\n    pass\n").body[0]
    assert _is_kernel(kernel)


def test_only_the_start_module_decides_where_a_run_starts():
    """checkpoint.py only writes and reads files; the loop asks resume.py how a run starts."""
    checkpoint = (PACKAGE / "training" / "checkpoint.py").read_text()
    for decision in ("def check_compatible", "def plan_start", "def check_same_shape", "def decide_start"):
        assert decision not in checkpoint
    loop = (PACKAGE / "training" / "loop.py").read_text()
    assert "resume.decide_start(" in loop and "plan_start(" not in loop and "check_compatible(" not in loop
