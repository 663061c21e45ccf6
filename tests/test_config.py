from pathlib import Path

import pytest

from leantune.config import ConfigError, load_config, parse_size

ROOT = Path(__file__).resolve().parents[1]

MINIMAL = """
[model]
path = "model"
[[data.datasets]]
path = "images"
"""


def write(tmp_path, text, name="run.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_minimal_config_gets_defaults_and_resolves_paths_from_its_folder(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.train.learning_rate == 1e-4 and cfg.lora.rank == 16 and cfg.memory.checkpointing == "none"
    assert cfg.resolve(cfg.model.path) == tmp_path.resolve() / "model"
    assert cfg.lora.effective_alpha == 16.0


def test_misspelled_key_names_file_section_key_and_suggestion(tmp_path):
    p = write(tmp_path, MINIMAL + "[train]\nlearning_rat = 1e-4\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert str(p) in msg and "[train]" in msg and "'learning_rat'" in msg and "did you mean 'learning_rate'" in msg


def test_unknown_key_in_dataset_table_names_the_table(tmp_path):
    p = write(tmp_path, MINIMAL + "reapeats = 3\n")
    with pytest.raises(ConfigError, match=r"\[\[data\.datasets\]\] #1: unknown key 'reapeats'; did you mean 'repeats'"):
        load_config(p)


def test_unknown_section_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"top level: unknown key 'trian'"):
        load_config(write(tmp_path, MINIMAL + "[trian]\nsteps = 3\n"))


def test_bad_values_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"\[train\]: key 'steps'"):
        load_config(write(tmp_path, MINIMAL + "[train]\nsteps = 0\n"))
    with pytest.raises(ConfigError, match=r"\[data\]: key 'resolutions'.*multiple of 16"):
        load_config(write(tmp_path, MINIMAL.replace("[[data", "[data]\nresolutions = [500]\n[[data")))
    with pytest.raises(ConfigError, match=r"\[sample\].*width"):
        load_config(write(tmp_path, MINIMAL + "[sample]\nwidth = 100\n"))


def test_fp8_modulation_values(tmp_path):
    """"auto" (default), true with fp8 or a budget, false; true without either, and any other value,
    are errors naming the key."""
    assert load_config(write(tmp_path, MINIMAL)).memory.fp8_modulation == "auto"
    for memory, want in (("fp8 = true\nfp8_modulation = true", True), ('vram_budget = "8GiB"\nfp8_modulation = true', True),
                         ("fp8_modulation = false", False)):
        assert load_config(write(tmp_path, MINIMAL + f"[memory]\n{memory}\n")).memory.fp8_modulation is want
    with pytest.raises(ConfigError, match=r"\[memory\] fp8_modulation = true .*set \[memory\] fp8 = true"):
        load_config(write(tmp_path, MINIMAL + "[memory]\nfp8_modulation = true\n"))
    with pytest.raises(ConfigError, match=r"\[memory\]: key 'fp8_modulation'"):
        load_config(write(tmp_path, MINIMAL + '[memory]\nfp8_modulation = "yes"\n'))


def test_missing_required_key(tmp_path):
    with pytest.raises(ConfigError, match=r"\[model\]: missing required key 'path'"):
        load_config(write(tmp_path, "[model]\n[[data.datasets]]\npath = 'x'\n"))


def test_set_overrides_are_validated_like_the_file(tmp_path):
    p = write(tmp_path, MINIMAL)
    cfg = load_config(p, ["train.steps=10", "lora.targets=attention", "memory.streamed_blocks=all",
                          "data.datasets.0.repeats=4", "sample.prompts=['a', 'b']"])
    assert cfg.train.steps == 10 and cfg.lora.targets == "attention" and cfg.memory.streamed_blocks == "all"
    assert cfg.data.datasets[0].repeats == 4 and cfg.sample.prompts == ["a", "b"]
    with pytest.raises(ConfigError, match="did you mean 'steps'"):
        load_config(p, ["train.stesp=10"])


def test_not_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[model\npath="))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.toml")


def test_validated_config_is_frozen(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    with pytest.raises(Exception):
        cfg.train.steps = 5


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.toml")), ids=lambda p: p.name)
def test_every_example_validates(path):
    """Each example is a config `leantune train` takes, of the family its name says."""
    cfg = load_config(path)
    named = {"flux": "flux", "quickstart": "flux", "sd3.5": "sd3", "qwen-image-2.1": "qwen-image-2.1",
             "qwen-image": "qwen-image", "qwen-image-edit": "qwen-image-edit", "flux2-klein-4b": "flux2-klein-4b",
             "flux2-dev": "flux2-dev", "z-image": "z-image",
             "krea2": "krea2", "wan2.2": "wan2.2", "wan2.2-ti2v": "wan2.2-ti2v"}
    prefix = max((p for p in named if path.name.startswith(p)), key=len)
    assert cfg.model.family == named[prefix], (path.name, cfg.model.family)


def test_there_is_an_example_for_every_family_with_a_stock_model():
    """The page offers the examples as presets: every family a user can plan by name has one."""
    from leantune.family_registry import FAMILIES

    have = {load_config(p).model.family for p in (ROOT / "examples").glob("*.toml")}
    missing = {f for f, entry in FAMILIES.items() if entry.stock} - have - {"flux2-klein-9b"}   # as klein 4B
    assert not missing, f"no example for {sorted(missing)}"


def test_quickstart_example_is_the_demo_config():
    from leantune.demo import quickstart_text

    assert (ROOT / "examples" / "quickstart.toml").read_text() == quickstart_text()


def test_parse_size():
    assert parse_size("8GiB") == 8 * 2**30 == parse_size("8 GB") == parse_size("8g")
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("8") == parse_size(" 8 ") == 8 * 2**30 and parse_size("1.5") == 3 * 2**29   # bare = GiB
    assert parse_size("512B") == 512
    with pytest.raises(ValueError):
        parse_size("lots")


def test_cli_reports_config_errors_with_exit_status_2(tmp_path, capsys):
    from leantune.cli import main

    p = write(tmp_path, MINIMAL + "[lora]\nrnak = 4\n")
    assert main(["train", str(p)]) == 2
    err = capsys.readouterr().err
    assert "leantune train:" in err and "unknown key 'rnak'; did you mean 'rank'" in err


def test_every_config_key_is_documented():
    """docs/config.md has a row for every key of every section, so the reference stays true."""
    from leantune import config as c

    doc = (ROOT / "docs" / "config.md").read_text()
    sections = {"model": c.ModelConfig, "data": c.DataConfig, "data.datasets": c.DatasetConfig,
                "lora": c.LoraConfig, "full": c.FullConfig, "train": c.TrainConfig, "memory": c.MemoryConfig,
                "sample": c.SampleConfig, "output": c.OutputConfig}
    for name, model in sections.items():
        heading = f"## [[{name}]]" if name == "data.datasets" else f"## [{name}]"
        assert heading in doc, heading
        body = doc.split(heading, 1)[1].split("\n## ", 1)[0]
        for key in model.model_fields:
            assert f"| `{key}` |" in body, f"{heading}: {key} is not documented"


@pytest.mark.parametrize("extra, message", [
    ("[train]\nmode = \"full\"\n[lora]\nrank = 8\n", r"\[lora\] rank: set, but \[train\] mode = \"full\""),
    ("[full]\nexclude = [\"x_embedder.*\"]\n", r"\[full\] exclude: set, but \[train\] mode = \"lora\""),
    ("[train]\nmode = \"full\"\n[memory]\nfp8 = true\n", r"\[memory\] fp8 = true with \[train\] mode = \"full\""),
    ("[train]\nmode = \"full\"\noptimizer = \"prodigy\"\n", r"\[train\] optimizer = 'prodigy' is for \[train\] mode = \"lora\""),
])
def test_wrong_mode_combinations_name_the_key(tmp_path, extra, message):
    p = write(tmp_path, MINIMAL + extra)
    with pytest.raises(ConfigError, match=message) as e:
        load_config(p)
    assert str(p) in str(e.value)


def test_full_mode_defaults_to_the_single_file_export_and_allows_a_frozen_fp8_part(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL + "[train]\nmode = \"full\"\n"))
    assert cfg.train.mode == "full" and cfg.output.formats == ["comfyui"] and cfg.full.train == ["*"]
    cfg = load_config(write(tmp_path, MINIMAL + "[train]\nmode = \"full\"\n[output]\nformats = [\"comfyui\", \"diffusers\"]\n"
                                       "[full]\nexclude = [\"single_transformer_blocks.*\"]\n[memory]\nfp8 = true\n"))
    assert cfg.output.formats == ["comfyui", "diffusers"] and cfg.memory.fp8
    assert load_config(write(tmp_path, MINIMAL)).output.formats == ["comfyui", "diffusers"]   # LoRA: unchanged


@pytest.mark.parametrize("section,key,value", [
    ("train", "learning_rate", "inf"), ("train", "learning_rate", "nan"), ("train", "learning_rate", "-1e-4"),
    ("train", "eps", "0.0"), ("train", "eps", "-1e-8"), ("train", "eps", "inf"),
    ("train", "betas", "[1.0, 0.999]"), ("train", "betas", "[0.9, -0.1]"), ("train", "betas", "[0.9, nan]"),
    ("lora", "alpha", "0.0"), ("lora", "alpha", "-4.0"), ("lora", "alpha", "inf"), ("lora", "alpha", "nan"),
    ("train", "weight_decay", "inf"),
])
def test_optimizer_and_lora_values_outside_their_domain_name_the_key(tmp_path, section, key, value):
    """Before: learning_rate = inf passed and trained a LoRA of NaN; eps and betas failed later as
    raw torch ValueErrors; alpha = 0 trained nothing and reported success."""
    p = write(tmp_path, MINIMAL + f"[{section}]\n{key} = {value}\n")
    with pytest.raises(ConfigError, match=rf"\[{section}\]: key '{key}'"):
        load_config(p)


def test_resolution_has_an_upper_bound(tmp_path):
    """Before: 100000 passed, and the bucket pass died in a MemoryError."""
    p = write(tmp_path, MINIMAL.replace("[[data", "[data]\nresolutions = [100000]\n[[data"))
    with pytest.raises(ConfigError, match=r"\[data\]: key 'resolutions'.*at most 4096"):
        load_config(p)
    assert load_config(write(tmp_path, MINIMAL.replace("[[data", "[data]\nresolutions = [4096]\n[[data"))) \
        .data.resolutions == [4096]
