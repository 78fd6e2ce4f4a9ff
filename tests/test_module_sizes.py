"""No module under orca_jax/ over 450 lines: past that a file has taken on a second job (issue 41).
Split it by role rather than raise the limit."""

from orca_jax.config import REPO_ROOT

MAX_LINES = 450


def test_no_module_under_orca_jax_is_over_450_lines():
    sizes = {path.relative_to(REPO_ROOT).as_posix(): len(path.read_text().splitlines())
             for path in sorted((REPO_ROOT / "orca_jax").rglob("*.py"))}
    over = {path: lines for path, lines in sizes.items() if lines > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split them by role): " + ", ".join(
        f"{path} ({lines})" for path, lines in sorted(over.items(), key=lambda item: -item[1]))
