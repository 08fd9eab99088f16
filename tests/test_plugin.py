"""The SGLang plugin: discoverable entry point, SGLANG_PLUGINS honoured, idempotent, version pin enforced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from sglang_ernie55 import compat, plugin
from sglang_ernie55.configuration import ARCH_ECHO, ARCH_MAIN, MODEL_TYPE

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


def test_register_twice_is_harmless(monkeypatch):
    from sglang.srt.models.registry import ModelRegistry

    monkeypatch.setattr(plugin, "_registered", False)
    plugin.register()
    before = dict(ModelRegistry.models)
    monkeypatch.setattr(plugin, "_registered", False)  # even without the fast-path flag
    plugin.register()
    plugin.register()
    assert ModelRegistry.models[ARCH_MAIN] is before[ARCH_MAIN]
    assert ModelRegistry.models[ARCH_MAIN].__module__ == "sglang_ernie55.models.ernie55"


def test_version_mismatch_names_both_versions(monkeypatch):
    import sglang

    monkeypatch.setattr(sglang, "__version__", "0.5.99")
    monkeypatch.delenv("SGLANG_ERNIE55_SKIP_VERSION_CHECK", raising=False)
    with pytest.raises(compat.SGLangVersionError, match=r"sglang==0\.5\.23.*sglang==0\.5\.99"):
        compat.check_version()
    monkeypatch.setattr(plugin, "_registered", False)
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
