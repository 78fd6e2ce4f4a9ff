"""README.md and docs/ against the code they describe. (`make docs` builds the site with --strict and
runs the runnable examples; these checks are the ones a plain `make test` can make in a second.)"""

import dataclasses
import re
import sys

from orca_jax.config import REPO_ROOT

README = REPO_ROOT / "README.md"
sys.path.insert(0, str(REPO_ROOT / "docs"))


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_readme_lists_exactly_the_makefile_targets():
    """README's command list is the user's map of `make`: a target added, renamed or dropped in one
    place and not the other fails here."""
    commands = section(README.read_text(), "Commands")
    listed = re.findall(r"^make ([\w-]+)", commands, flags=re.M)
    makefile = (REPO_ROOT / "Makefile").read_text()
    targets = [t for line in re.findall(r"^\.PHONY:(.*)$", makefile, flags=re.M) for t in line.split()]
    assert len(listed) == len(set(listed)), f"README lists a target twice: {listed}"
    assert sorted(listed) == sorted(set(targets)), (
        f"README's Commands list {sorted(listed)} but the Makefile's targets are {sorted(set(targets))}")


def test_readme_links_point_to_files_that_exist():
    """mkdocs checks the links of docs/; README is outside the site, so its relative links are checked here."""
    for target in re.findall(r"\]\((?!https?://|#)([^)#\s]+)", README.read_text()):
        assert (REPO_ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_readme_stays_short_and_its_headline_table_current():
    """The manual lives in docs/ and measured history in bench/results/ (issue 42): README stays a
    page a user reads in five minutes, and its figures are generated from bench/results/latest/."""
    import gen_performance

    text = README.read_text()
    assert len(text.splitlines()) <= 250, "README.md is over 250 lines: move the detail into a docs/ page"
    assert gen_performance.readme_with_headline(text) == text, (
        "README's headline table differs from bench/results/latest/: run "
        "`python docs/gen_performance.py --write-readme`")


def test_configuration_page_documents_every_setting():
    """The configuration page is generated from the settings' declaration: every setting, and every
    key of a section given whole, appears with its flag and LLM keyword."""
    import gen_config_reference
    from orca_jax.engine_args import SETTINGS

    page = gen_config_reference.page()
    for s in SETTINGS:
        if s.table_class is None:
            assert f"| `{s.name}`" in page and f"| `{s.flag}` |" in page, s.toml_key
            assert s.keyword == s.name or f"LLM: `{s.keyword}`" in page, s.keyword
        else:
            assert f"## [{s.name}]" in page, s.name
            for f in dataclasses.fields(s.table_class):
                assert f"| `{f.name}` |" in page, f"{s.name}.{f.name}"


def test_models_page_lists_exactly_the_gguf_pre_tokenizers():
    """docs/models.md's GGUF tokenizer table names every pre-tokenizer the import accepts, and no other."""
    from orca_jax.checkpoint.gguf_pre_tokenizers import PRE_TOKENIZERS

    page = (REPO_ROOT / "docs" / "models.md").read_text()
    [row] = re.findall(r"^\| `gpt2` \| byte-level BPE \|(.*)\|$", page, flags=re.M)
    assert sorted(re.findall(r"`([^`]+)`", row)) == sorted(PRE_TOKENIZERS)
