"""The shipped page (ui/static/index.html) as a newcomer meets it (issue 42): the sections in the
order a user works, the basic fields first and the rest under "Advanced", one line of help tied to
each field, the optional auto-caption group after the dataset with labels of its own, a checklist
by Start, and the page served with the view it is asked for. Read from the HTML itself with the
standard library's parser (tests/test_ui_browser.py drives it in a browser)."""

from __future__ import annotations

import html.parser
import re

from leantune.ui.form import RunForm
from leantune.ui.labels import PAGE, labels


class _Page(html.parser.HTMLParser):
    """Every element with an id: its tag, attributes, and the ids of the <section>, <fieldset> and
    <details> around it; the sections in page order."""

    def __init__(self):
        super().__init__()
        self.stack: list[tuple[str, dict]] = []
        self.elements: dict[str, dict] = {}
        self.sections: list[str] = []
        self.order: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.sections.append(a.get("id"))
        if a.get("id"):
            self.order.append(a["id"])
            self.elements[a["id"]] = {"tag": tag, "attrs": a, "within": [(t, dict(x)) for t, x in self.stack]}
        if tag not in ("input", "meta", "link", "br", "img"):
            self.stack.append((tag, a))

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()[0] == tag:
                break


def _page() -> _Page:
    p = _Page()
    p.feed(PAGE.read_text())
    return p


def _section(p: _Page, ident: str) -> str:
    return next(a.get("id") for t, a in p.elements[ident]["within"] if t == "section")


def _advanced(p: _Page, ident: str) -> bool:
    return any(t == "details" and "advanced" in a.get("class", "") for t, a in p.elements[ident]["within"])


def test_sections_come_in_the_order_a_user_works():
    assert _page().sections == ["dataset-section", "model-section", "recipe-section", "run-section", "watch-section",
                                "sample-section"]


def test_basic_fields_first_and_the_rest_under_advanced():
    p = _page()
    basic = {"dataset": "dataset-section", "trigger_word": "dataset-section", "model_path": "model-section",
             "family": "model-section", "vram_budget": "model-section", "ram_budget": "model-section",
             "name": "recipe-section", "mode": "recipe-section", "rank": "recipe-section", "resolutions": "recipe-section",
             "steps": "recipe-section", "learning_rate": "recipe-section", "sample_prompts": "recipe-section",
             "sample_every": "recipe-section"}
    for ident, section in basic.items():
        assert _section(p, ident) == section and not _advanced(p, ident), ident
    rest = set(RunForm().as_fields()) - set(basic)
    assert rest and all(_advanced(p, ident) for ident in rest), sorted(i for i in rest if not _advanced(p, i))
    for section in ("dataset-section", "model-section", "recipe-section"):     # within a section: basic, then advanced
        ids = [i for i in p.order if i in RunForm().as_fields() and _section(p, i) == section]
        flags = [_advanced(p, i) for i in ids]
        assert flags == sorted(flags), (section, ids)


def test_every_field_has_one_line_of_help_tied_to_it():
    p = _page()
    for ident in [*RunForm().as_fields(), "caption_model", "caption_prompt", "upload"]:
        described = p.elements[ident]["attrs"].get("aria-describedby", "").split()
        assert f"{ident}-help" in described, ident
        help_text = re.search(rf'id="{ident}-help"[^>]*>(.*?)</small>', PAGE.read_text(), re.S).group(1)
        assert 20 < len(help_text) < 200 and "\n" not in help_text, (ident, help_text)


def test_the_caption_writer_is_its_own_optional_group_after_the_dataset_with_labels_of_its_own():
    p = _page()
    group = [a for t, a in p.elements["caption_model"]["within"] if t == "fieldset"]
    assert group and group[-1].get("id") == "caption-group" and "optional" in group[-1].get("class", "")
    assert _section(p, "caption_model") == "dataset-section"
    assert p.order.index("dataset") < p.order.index("caption-group") < p.order.index("model_path")
    words = lambda ident: set(re.findall(r"[a-z]+", labels()[ident].lower()))
    for caption in ("caption_model", "caption_prompt"):
        for other in ("model_path", "sample_prompts", "s_model", "s_prompts"):
            assert not words(caption) & words(other), (caption, other, words(caption) & words(other))


def test_the_run_forms_labels_are_unique_so_a_walk_by_label_finds_one_control():
    names = [labels()[k].lower() for k in [*RunForm().as_fields(), "caption_model", "caption_prompt", "upload"]]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for name in names:                   # nor is one label a part of another (a substring match finds both)
        assert not [m for m in names if m != name and re.search(rf"\b{re.escape(name)}\b", m)], name


def test_a_checklist_by_start_and_a_nav_to_the_sections():
    p = _page()
    assert _section(p, "checklist") == _section(p, "start") == "run-section"
    assert p.order.index("checklist") < p.order.index("start")
    assert "checklist" in p.elements["start"]["attrs"].get("aria-describedby", "")
    nav = re.search(r'<nav id="nav".*?</nav>', PAGE.read_text(), re.S).group(0)
    targets = re.findall(r'data-section="([a-z]+)"', nav)
    assert targets and all(f"{t}-section" in p.sections for t in targets)
