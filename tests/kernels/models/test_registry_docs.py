"""The supported-models lists a user reads are the registry's own."""

from pathlib import Path

from tokenloom.kernels.models.registry import markdown_table, supported_architectures

ROOT = Path(__file__).resolve().parents[3]


def test_models_page_table_is_the_registry():
    page = (ROOT / "docs" / "models.md").read_text()
    start = page.index("<!-- registry-table")
    table = page[page.index("\n", page.index("-->", start)) + 1:page.index("<!-- end registry")]
    assert table.strip() == markdown_table(), \
        "docs/models.md is stale: paste `python -m tokenloom.kernels.models.registry`"


def test_readme_and_configuration_name_every_architecture():
    for doc in (ROOT / "README.md", ROOT / "docs" / "configuration.md"):
        text = doc.read_text()
        missing = [a for a in supported_architectures() if f"`{a}`" not in text]
        assert not missing, f"{doc.name} does not list {missing}"
