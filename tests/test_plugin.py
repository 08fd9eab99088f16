"""The SGLang plugin: discoverable entry point, SGLANG_PLUGINS honoured, idempotent, version pin enforced;
the patch ledger: one row per SGLang target, one hook per target, the only place that registers anything
with SGLang, derived compat list, and docs/hooks.md as its prose twin."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from sglang_ernie55 import compat, patches, plugin
from sglang_ernie55.configuration import ARCH_ECHO, ARCH_MAIN, MODEL_TYPE
from sglang_ernie55.patches import Kind

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "sglang_ernie55"
HOOK_KINDS = (Kind.AROUND, Kind.AFTER)

PROBE = f"""
import json
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.utils.hf_transformers.common import _CONFIG_REGISTRY
print("PROBE" + json.dumps({{a: getattr(ModelRegistry.models.get(a), "__module__", None) for a in {[ARCH_MAIN, ARCH_ECHO]!r}}}
                          | {{"config": "{MODEL_TYPE}" in _CONFIG_REGISTRY}}))
"""


def _probe(env_plugins: str | None) -> dict:
    env = dict(os.environ)
    env.pop("SGLANG_PLUGINS", None)
    if env_plugins is not None:
        env["SGLANG_PLUGINS"] = env_plugins
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("PROBE")]
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(line[0][5:])


def test_entry_point_is_discoverable():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "ernie55"]
    assert len(eps) == 1 and eps[0].value == "sglang_ernie55.plugin:register"
    assert eps[0].load() is plugin.register


@pytest.mark.slow
@pytest.mark.parametrize("whitelist, expect", [(None, True), ("some_other_plugin", False)])
def test_sglang_plugins_whitelist(whitelist, expect):
    got = _probe(whitelist)
    registered = got[ARCH_MAIN] is not None
    assert registered is expect, got
    assert (got[ARCH_ECHO] is not None) is expect
    assert got["config"] is expect
    if expect:
        assert got[ARCH_MAIN] == "sglang_ernie55.models.ernie55"


def test_register_twice_is_harmless():
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin.register()
    before = dict(ModelRegistry.models)
    plugin.register()
    patches.register()
    assert patches.applied()
    assert ModelRegistry.models[ARCH_MAIN] is before[ARCH_MAIN]
    assert ModelRegistry.models[ARCH_MAIN].__module__ == "sglang_ernie55.models.ernie55"
    assert ATTENTION_BACKEND_CHOICES.count("ernie55") == 1
    for row in patches.rows(*HOOK_KINDS):
        assert [h for _, h, _ in HookRegistry._hooks[row.dotted]].count(row.function()) == 1, row.target


def test_each_target_is_patched_by_one_hook():
    """One HookRegistry hook per target (no "Multiple AROUND hooks" warning, no nesting order to get right):
    the target and ECHO draft pools come from the same hook."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    plugin.register()
    targets = [row.target for row in patches.LEDGER]
    assert len(targets) == len(set(targets))
    for row in patches.rows(*HOOK_KINDS):
        assert len(HookRegistry._hooks[row.dotted]) == 1, (row.target, HookRegistry._hooks[row.dotted])


def test_version_mismatch_names_both_versions(monkeypatch):
    import sglang

    monkeypatch.setattr(sglang, "__version__", "0.5.99")
    monkeypatch.delenv("SGLANG_ERNIE55_SKIP_VERSION_CHECK", raising=False)
    with pytest.raises(compat.SGLangVersionError, match=r"sglang==0\.5\.23.*sglang==0\.5\.99"):
        compat.check_version()
    monkeypatch.setattr(patches, "_applied", False)  # a fresh process: checked before anything is patched
    with pytest.raises(compat.SGLangVersionError):
        plugin.register()


def test_symbol_check_names_missing_and_changed_symbols():
    with pytest.raises(compat.SGLangVersionError, match="ModelRegistry.no_such_method"):
        compat.check_symbols([("sglang.srt.models.registry", "ModelRegistry.no_such_method", None)])
    with pytest.raises(compat.SGLangVersionError, match="expected it to start with"):
        compat.check_symbols([("sglang.srt.models.registry", "ModelRegistry.register", ("model_name",))])
    compat.check_symbols()  # every symbol the plugin hooks exists in the pinned SGLang


def test_model_placeholders_are_resolved_through_sglang(tmp_path):
    """SGLang's ModelConfig on a tiny config resolves to this project's class."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.models.registry import ModelRegistry

    from sglang_ernie55.configuration import tiny_config

    plugin.register()
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_config_json()))
    mc = ModelConfig(model_path=str(tmp_path))
    cls, arch = ModelRegistry.resolve_model_cls(mc.hf_config.architectures)
    assert arch == ARCH_MAIN and cls.__module__ == "sglang_ernie55.models.ernie55"
    assert type(mc.hf_config).__name__ == "Ernie55Config"


# ============================================================================================ the ledger
def test_ledger_rows_are_complete():
    """Every patch row names what we attach (importable), why and when it can go; every read row the module
    that reads it; the compat check is the ledger's list, nothing kept by hand."""
    import importlib.util

    for row in patches.LEDGER:
        assert row.why, row.target
        if row.kind is Kind.READS:
            assert row.ours is None and importlib.util.find_spec(row.by) is not None, row.target
        else:
            assert row.until and row.function() is not None, row.target
    assert compat.REQUIRED_SYMBOLS == patches.required_symbols()
    assert len(compat.REQUIRED_SYMBOLS) == len(patches.LEDGER)


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


REGISTRATION_NAMES = {
    "register_resolution_hook",
    "register_model_override",
    "register_attention_backend",
    "_CONFIG_REGISTRY",
    "_registered",
}
REGISTRATION_CALLS = {("HookRegistry", "register"), ("ModelRegistry", "register"), ("AutoConfig", "register")}


def test_only_the_ledger_registers_with_sglang():
    """No module but patches.py registers hooks, overrides, resolution hooks, backends, choices, configs or
    models with SGLang, and none keeps a registration guard of its own."""
    found = []
    for path, tree in _modules():
        if path.name == "patches.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(tree):
            name = (
                node.id if isinstance(node, ast.Name) else node.name if isinstance(node, ast.alias) else None
            )
            if isinstance(node, ast.alias):
                name = name.rpartition(".")[2]
            if name and (name in REGISTRATION_NAMES or re.fullmatch(r"add_\w+_choices", name)):
                found.append(f"{path.relative_to(REPO)}:{getattr(node, 'lineno', '?')} {name}")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if (node.value.id, node.attr) in REGISTRATION_CALLS:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.value.id}.{node.attr}")
    assert not found, found


def test_patches_ask_arch_whether_the_model_is_ernie55():
    """The modules that hold our side of a patch decide "is this ERNIE-5.5 / the ECHO draft?" through
    sglang_ernie55.arch only: none reads `architectures` itself (the draft-arch patch writes it)."""
    homes = {
        row.ours_module() for row in patches.LEDGER if row.kind not in (Kind.READS, Kind.MODELS, Kind.CONFIG)
    }
    checked = []
    for module in sorted(homes):
        path = PACKAGE.joinpath(*module.split(".")[1:])
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        tree = ast.parse(path.read_text())
        stores = {
            id(node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
        }
        for node in ast.walk(tree):
            reads_attr = (
                isinstance(node, ast.Attribute) and node.attr == "architectures" and id(node) not in stores
            )
            reads_str = isinstance(node, ast.Constant) and node.value == "architectures"
            assert not (reads_attr or reads_str), (
                f"{path.relative_to(REPO)}:{node.lineno} reads `architectures`"
            )
        checked.append(module)
    assert "sglang_ernie55.mem_cache" in checked and "sglang_ernie55.args.requests" in checked


def _hooks_md_entries(text: str) -> dict[str, dict[str, str]]:
    """The entries of docs/hooks.md (headings "### `target`") -> {"Kind" / "Why" / "How" / "When it can go":
    the bullet's text on one line}."""
    entries: dict[str, dict[str, str]] = {}
    for block in re.split(r"^### ", text, flags=re.M)[1:]:
        head, _, body = block.partition("\n")
        if not head.startswith("`"):
            continue
        bullets: dict[str, str] = {}
        for item in re.split(r"^- ", body.split("\n## ")[0], flags=re.M)[1:]:
            m = re.match(r"\*\*([^*]+):\*\* (.*)", " ".join(item.split()), flags=re.S)
            if m:
                bullets[m.group(1)] = m.group(2)
        assert head.strip("`") not in entries, f"two entries for {head}"
        entries[head.strip("`")] = bullets
    return entries


def test_hooks_md_is_the_ledgers_prose():
    """docs/hooks.md: the generated index and read lists are current, and there is one entry per patch row,
    in table order, with the row's kind and function, Why starting with the row's why and When it can go
    with its until."""
    text = (REPO / "docs" / "hooks.md").read_text()
    assert patches.ledger_markdown() in text
    assert patches.reads_markdown() in text
    entries = _hooks_md_entries(text)
    wanted = [row for row in patches.LEDGER if row.kind is not Kind.READS]
    assert list(entries) == [row.target for row in wanted]
    for row in wanted:
        entry = entries[row.target]
        assert entry["Kind"] == f"{row.kind.value}; ours: `{row.ours}`", row.target
        assert entry["Why"].startswith(row.why), (row.target, entry["Why"])
        assert entry["How"], row.target
        assert entry["When it can go"].startswith(row.until), (row.target, entry["When it can go"])
