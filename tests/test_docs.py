"""The docs stay true to the code: every configuration key of the schema is documented in
docs/configuration.md (and nothing documented there is missing from the schema), and every
relative link in README.md and docs/, and every `docs/<page>.md#anchor` cited in the code,
points at a file that exists and a heading that is there."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

from pydantic import BaseModel

from core.settings import Config

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "configuration.md"
# the packages whose comments and docstrings may cite docs pages; one that does not exist
# (yet) is skipped
CODE_DIRS = ("core", "gateway", "adapters", "tenancy", "agent", "bench", "tests")


# ----- configuration keys ------------------------------------------------------------------


def _models_in(annotation: object) -> list[type[BaseModel]]:
    """The BaseModel classes an annotation holds directly (`Model`, `Model | None`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]
    return []


def _item_models(annotation: object) -> list[type[BaseModel]]:
    """The models a container annotation holds as items: `dict[str, Model]`, `list[Model]`,
    `tuple[Model, ...]`, also inside `| None`."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [m for arg in typing.get_args(annotation) for m in _item_models(arg)]
    if origin in (dict, typing.Mapping):
        args = typing.get_args(annotation)
        return _models_in(args[1]) if len(args) == 2 else []
    if origin in (list, set, frozenset, tuple, typing.Sequence):
        return [m for arg in typing.get_args(annotation) if arg is not Ellipsis for m in _models_in(arg)]
    return []


def schema_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every settable key of `model` as a dotted path. A nested model is a section: its own
    keys are listed, not the section. A dict or list of models is a key itself, and the
    items' keys are listed under `<key>.*`."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{field.alias or name}"
        annotation = field.annotation
        if nested := _models_in(annotation):
            for sub in nested:
                keys |= schema_keys(sub, f"{path}.")
            continue
        keys.add(path)
        for sub in _item_models(annotation):
            keys |= schema_keys(sub, f"{path}.*.")
    return keys


# a documented key: a table row whose first cell is a backticked dotted path
_DOC_KEY = re.compile(r"^\|\s*`([a-z_][a-z0-9_]*(?:\.(?:[a-z0-9_]+|\*))*)`\s*\|", re.M)


def documented_keys(text: str) -> set[str]:
    return set(_DOC_KEY.findall(_without_code_blocks(text)))


def test_schema_walk_reaches_nested_dict_and_list_models() -> None:
    class Leaf(BaseModel):
        x: int = 0

    class Section(BaseModel):
        leaf: Leaf = Leaf()
        maybe: Leaf | None = None
        by_name: dict[str, Leaf] = {}
        items: list[Leaf] = []
        plain: dict[str, float] = {}

    class Top(BaseModel):
        section: Section = Section()
        name: str = ""

    assert schema_keys(Top) == {
        "name",
        "section.leaf.x",
        "section.maybe.x",
        "section.by_name",
        "section.by_name.*.x",
        "section.items",
        "section.items.*.x",
        "section.plain",
    }
    assert documented_keys("| `a.b` | int |\n| `c.*.d` | x |\n```\n| `e.f` | in code |\n```\n") == {"a.b", "c.*.d"}


def test_every_configuration_key_is_documented_and_every_documented_key_exists() -> None:
    schema = schema_keys(Config)
    assert {"data_dir", "llm.base_url", "platforms.telegram.webhook.port", "cluster.node_id"} <= schema
    documented = documented_keys(CONFIG_DOC.read_text(encoding="utf-8"))
    undocumented = sorted(schema - documented)
    unknown = sorted(documented - schema)
    assert not undocumented and not unknown, (
        f"keys of the schema missing from docs/configuration.md: {undocumented}; "
        f"keys documented there that the schema does not have: {unknown}"
    )


# ----- links and anchors ---------------------------------------------------------------------

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
_HTML_ID = re.compile(r"""<a\s+(?:id|name)=["']([^"']+)["']""")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_CODE_CITATION = re.compile(r"\bdocs/[\w./-]+?\.md(?:#[\w-]+)?")


def _without_code_blocks(text: str) -> str:
    return _FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lowercased, punctuation removed
    except `-` and `_`, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link shows its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML shows nothing of its tags
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a markdown file has: its headings' slugs (a repeated one gets -1, -2, ...
    as GitHub does) and explicit `<a id=...>` anchors."""
    text = _without_code_blocks(path.read_text(encoding="utf-8"))
    found: set[str] = set(_HTML_ID.findall(text))
    seen: dict[str, int] = {}
    for _level, title in _HEADING.findall(text):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def markdown_links(path: Path) -> list[str]:
    """The link targets of a markdown file, outside code blocks and inline code."""
    text = _INLINE_CODE.sub("", _without_code_blocks(path.read_text(encoding="utf-8")))
    return _LINK.findall(text) + _REF_DEF.findall(text)


def _is_external(target: str) -> bool:
    return bool(re.match(r"[a-z][a-z0-9+.-]*:", target, re.I)) or target.startswith("//")


def _problem(source: Path, target: str, base: Path) -> str | None:
    """What is wrong with `target` (relative to `base`) as cited in `source`, or None."""
    file_part, _, anchor = target.partition("#")
    dest = (base / file_part).resolve() if file_part else source
    where = f"{source.relative_to(ROOT)}: {target}"
    if not dest.exists():
        return f"{where}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist"
    if anchor:
        if dest.is_dir() or dest.suffix.lower() != ".md":
            return f"{where}: an anchor into something that is not a markdown file"
        if anchor not in anchors(dest):
            return f"{where}: no heading in {dest.relative_to(ROOT)} has the anchor #{anchor}"
    return None


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def code_files() -> list[Path]:
    files: list[Path] = []
    for d in CODE_DIRS:
        if (ROOT / d).is_dir():
            files += sorted(p for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts)
    return files


def test_slug_follows_github() -> None:
    assert slug("What happens when something fails") == "what-happens-when-something-fails"
    assert slug("Photos, voice notes and files") == "photos-voice-notes-and-files"
    assert slug("1. Create the bot") == "1-create-the-bot"
    assert slug("Docker / compose") == "docker--compose"
    assert slug("`gateway_bench.py`: gateway throughput") == "gateway_benchpy-gateway-throughput"
    assert slug("Ingress: who receives") == "ingress-who-receives"


def test_every_docs_link_and_anchor_resolves() -> None:
    problems: list[str] = []
    checked = 0
    for doc in doc_files():
        for target in markdown_links(doc):
            if _is_external(target):
                continue
            checked += 1
            if (p := _problem(doc, target, doc.parent)) is not None:
                problems.append(p)
    for source in code_files():
        for target in _CODE_CITATION.findall(source.read_text(encoding="utf-8")):
            checked += 1
            if (p := _problem(source, target, ROOT)) is not None:
                problems.append(p)
    assert checked > 20, "found almost no links: the link pattern is broken"
    assert not problems, "links that do not resolve:\n" + "\n".join(problems)


_STALE_CITATION = re.compile(r"README(\.md)? *\"|\b[Ii]ssues? #?\d+")


def stale_citations(text: str) -> list[str]:
    """Lines that cite a README heading or an issue number (both move or close; a docs
    page and its anchor are checked by the link test)."""
    return [line.strip() for line in text.splitlines() if _STALE_CITATION.search(line)]


def test_code_cites_docs_pages_not_readme_headings_or_issue_numbers():
    found = []
    for top in ("core", "gateway", "adapters", "tenancy", "agent", "bench", "tests"):
        for path in sorted((ROOT / top).rglob("*.py")) if (ROOT / top).is_dir() else []:
            if path.name == "test_docs.py":
                continue
            found += [f"{path.relative_to(ROOT)}: {line}" for line in stale_citations(path.read_text(encoding="utf-8"))]
    assert not found, "cite docs/<page>.md#anchor instead:\n" + "\n".join(found)


def test_the_citation_check_sees_both_kinds():
    assert stale_citations('x = 1  # see README "Delivery"\n"""(issue 13)"""\nok = "docs/concepts.md#delivery"') == [
        'x = 1  # see README "Delivery"',
        '"""(issue 13)"""',
    ]
