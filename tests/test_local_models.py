"""A user's own decoder (nvfp4lab.local_models): every architecture of issue 34 as a seeded
random tiny model written in the Hugging Face cache layout (sharded bf16), found by snapshot
folder, ``models--org--name`` folder and ``org/name``, loaded, and its logits bit-equal to the
in-memory model's; SmolLM2 as a user's GGUF file; every refusal in one line. Nothing touches the
network: each test fails if a socket connects or a host name is looked up."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from nvfp4lab import local_models, models, settings
from nvfp4lab.checkpoint.records import SOURCE_ATTRIBUTE
from nvfp4lab.checkpoint.refusals import CheckpointError
from nvfp4lab.local_models import (
    DecoderInfo,
    ModelKind,
    ModelSource,
    check_decoder,
    check_projections,
    check_tokenizer,
    load_decoder,
    resolve_model,
)
from tests.conftest import needs_smollm2
from tests.tiny_decoders import (
    ARCHITECTURES,
    cast_parameters,
    save_hf_cache,
    tiny_config,
    tiny_model,
    tiny_tokenizer,
)

TEXT = "The quick brown fox jumps over the lazy dog; 0123456789!\n\tNVFP4 keeps 16 per block."


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Record (and refuse) every connection and name lookup; the test fails if there was one,
    even if the library caught the error. HF_HUB_OFFLINE=1, as every command sets it."""
    attempts: list[str] = []

    def refuse(what: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            attempts.append(f"{what}{args[1:2] or args[:1]}")
            raise OSError(f"test: no network ({what})")
        return call

    monkeypatch.setattr(socket.socket, "connect", refuse("connect"))
    monkeypatch.setattr(socket.socket, "connect_ex", refuse("connect_ex"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield
    assert attempts == [], f"network attempted: {attempts}"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


def _ids(tokenizer: Any) -> torch.Tensor:
    ids = tokenizer(TEXT)["input_ids"]
    assert max(ids) < 256 and tokenizer.unk_token_id not in ids
    return torch.tensor([ids])


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


# ---------------------------------------------------------------------------------------------
# the tiny models and the cache layout


def test_cache_layout_is_the_hub_cache(tmp_path: Path, tokenizer: Any) -> None:
    """save_hf_cache writes what huggingface_hub itself reads as a cached download."""
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    snap = save_hf_cache(tiny_model("llama"), tokenizer, tmp_path, repo_id="tiny-org/tiny-llama")
    repo = tmp_path / "models--tiny-org--tiny-llama"
    assert snap.parent == repo / "snapshots" and len(snap.name) == 40
    assert (repo / "refs" / "main").read_text() == snap.name
    names = sorted(p.name for p in snap.iterdir())
    assert names == ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
                     "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                     "tokenizer.json", "tokenizer_config.json"]
    for link in snap.iterdir():
        target = os.readlink(link)
        assert link.is_symlink() and target.startswith("../../blobs/"), (link, target)
        assert link.resolve().parent == (repo / "blobs").resolve()
    (info,) = scan_cache_dir(tmp_path).repos
    assert info.repo_id == "tiny-org/tiny-llama" and [r.commit_hash for r in info.revisions] \
        == [snap.name]
    found = try_to_load_from_cache("tiny-org/tiny-llama", "config.json", cache_dir=tmp_path)
    assert Path(str(found)) == snap / "config.json"
    from safetensors import safe_open

    for shard in snap.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            keys = handle.keys()
            assert {handle.get_slice(k).get_dtype() for k in keys} == {"BF16"}


def test_tiny_models_are_seeded() -> None:
    """The same seed gives the same weights; another seed other weights."""
    a, b, c = tiny_model("qwen3", seed=1), tiny_model("qwen3", seed=1), tiny_model("qwen3", seed=2)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"],
                           sc["model.layers.0.self_attn.q_proj.weight"])


# ---------------------------------------------------------------------------------------------
# every architecture: resolved three ways, loaded, logits bit-equal


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_resolve_and_load(model_type: str, tmp_path: Path, tokenizer: Any,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model = tiny_model(model_type, seed=3)
    repo_id = f"tiny-org/{model_type}"
    snap = save_hf_cache(model, tokenizer, tmp_path / "hub", repo_id=repo_id)
    ids = _ids(tokenizer)
    expected = _logits(cast_parameters(model, torch.bfloat16), ids)
    assert expected.dtype == torch.bfloat16 and expected.shape == (1, ids.shape[1], 256)
    config = tiny_config(model_type)
    for spec in (snap, str(snap.parent.parent), repo_id):
        source = resolve_model(spec)
        assert source == ModelSource(ModelKind.FOLDER, snap, repo_id, snap.name)
        info = check_decoder(source)
        assert info == DecoderInfo(
            source, model_type, (type(model).__name__,), 2, 64, 4, 2,
            getattr(config, "head_dim", None) or 16, 256, "bfloat16",
            sum(p.numel() for p in model.parameters()),
            sum(f.stat().st_size for f in snap.glob("*.safetensors")),
            config.tie_word_embeddings, True)
        loaded, loaded_tokenizer = load_decoder(source)
        assert not loaded.training and loaded.dtype == torch.bfloat16
        assert not hasattr(loaded, SOURCE_ATTRIBUTE)
        assert loaded_tokenizer(TEXT)["input_ids"] == ids[0].tolist()
        assert torch.equal(_logits(loaded, ids), expected)


def test_dtype_option(tmp_path: Path, tokenizer: Any) -> None:
    """dtype="float32" loads the bf16 weights widened (exactly); a bad dtype is refused."""
    model = tiny_model("mistral")
    source = resolve_model(save_hf_cache(model, tokenizer, tmp_path))
    ids = _ids(tokenizer)
    widened = cast_parameters(cast_parameters(model, torch.bfloat16), torch.float32)
    loaded, _ = load_decoder(source, dtype="float32")
    assert loaded.dtype == torch.float32
    assert torch.equal(_logits(loaded, ids), _logits(widened, ids))
    with pytest.raises(ValueError, match=r"dtype must be one of float32, bfloat16, float16 \(or "
                                         r"None: the checkpoint's own, bfloat16\), got 'int8'"):
        load_decoder(source, dtype="int8")


def test_plain_save_pretrained_folder(tmp_path: Path, tokenizer: Any) -> None:
    """A plain float32 save_pretrained folder (one file, no links) loads in float32."""
    model = tiny_model("olmo2")
    model.save_pretrained(str(tmp_path / "mine"))
    tokenizer.save_pretrained(str(tmp_path / "mine"))
    source = resolve_model(tmp_path / "mine")
    assert source == ModelSource(ModelKind.FOLDER, tmp_path / "mine", "mine")
    assert check_decoder(source).dtype == "float32"
    loaded, _ = load_decoder(source)
    ids = _ids(tokenizer)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


# ---------------------------------------------------------------------------------------------
# cache folders and names


def test_snapshot_choice(tmp_path: Path, tokenizer: Any) -> None:
    """A models--* folder: refs/main's snapshot; without refs/main its only snapshot; several
    and no ref: refused, naming them."""
    snap = save_hf_cache(tiny_model("llama"), tokenizer, tmp_path)
    repo = snap.parent.parent
    other = repo / "snapshots" / ("f" * 40)
    shutil.copytree(snap, other, symlinks=True)
    assert resolve_model(repo).path == snap  # refs/main
    (repo / "refs" / "main").unlink()
    with pytest.raises(ValueError, match=rf"{repo} has 2 snapshots and no refs/main to choose "
                                         rf"one; pass one of the snapshot folders \({snap}, "):
        resolve_model(repo)
    shutil.rmtree(snap)
    assert resolve_model(repo) == ModelSource(ModelKind.FOLDER, other, "tiny-org/tiny-llama",
                                              "f" * 40)


def test_name_not_in_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """org/name absent from the cache: one line naming where it looked, nothing downloaded,
    HF_HUB_OFFLINE said when set (and the network fixture proves nothing was tried)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    where = tmp_path / "models--acme--absent-7b"
    with pytest.raises(ValueError, match=r"^'acme/absent-7b' is not a local folder and not in the "
                       rf"local Hugging Face cache \(looked for {where}\); nvfp4lab downloads "
                       r"nothing \(HF_HUB_OFFLINE is set and honoured.*\): download it first"):
        resolve_model("acme/absent-7b")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    with pytest.raises(ValueError, match=r"downloads nothing: download it first") as info:
        resolve_model("acme/absent-7b")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"nowhere/at/all: no such file or folder"):
        resolve_model("nowhere/at/all")


def test_hf_cache_settings() -> None:
    """settings.hf_hub_cache follows huggingface_hub's order; hf_offline its true values."""
    home = Path.home()
    assert settings.hf_hub_cache({}) == home / ".cache" / "huggingface" / "hub"
    assert settings.hf_hub_cache({"XDG_CACHE_HOME": "/x"}) == Path("/x/huggingface/hub")
    assert settings.hf_hub_cache({"HF_HOME": "/h", "XDG_CACHE_HOME": "/x"}) == Path("/h/hub")
    assert settings.hf_hub_cache({"HF_HUB_CACHE": "/c", "HF_HOME": "/h"}) == Path("/c")
    assert [settings.hf_offline({"HF_HUB_OFFLINE": v}) for v in ("1", "yes", "On", "0", "")] \
        == [True, True, True, False, False]
    assert settings.hf_offline({"TRANSFORMERS_OFFLINE": "1"})


# ---------------------------------------------------------------------------------------------
# refusals


def _folder(tmp_path: Path, config: Any, name: str = "model") -> Path:
    folder = tmp_path / name
    config.save_pretrained(str(folder))
    return folder


def test_refuses_folder_without_config(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    message = (f"{tmp_path / 'weights'} has no config.json: not a transformers model folder; "
               "give the folder that holds config.json and *.safetensors")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        resolve_model(tmp_path / "weights")
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_decoder(ModelSource(ModelKind.FOLDER, tmp_path / "weights", "weights"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match=r"notes.txt is a file, not a model"):
        resolve_model(tmp_path / "notes.txt")


def test_refuses_missing_and_pickle_weights(tmp_path: Path) -> None:
    folder = _folder(tmp_path, tiny_config("llama"))
    source = resolve_model(folder)
    with pytest.raises(CheckpointError, match=f"{folder} holds no .safetensors weight file"):
        check_decoder(source)
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin is a pickle file .* never "
                                              r"unpickles"):
        check_decoder(source)


def test_refuses_remote_code_unless_trusted(tmp_path: Path, tokenizer: Any) -> None:
    snap = save_hf_cache(tiny_model("llama"), tokenizer, tmp_path / "hub")
    folder = tmp_path / "copy"
    shutil.copytree(snap, folder)  # links followed: plain files
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    source = resolve_model(folder)
    with pytest.raises(ValueError, match=r"needs trust_remote_code \(config.json's auto_map names "
                                         r"code shipped with it: AutoModelForCausalLM\); pass "
                                         r"trust_remote_code=True"):
        check_decoder(source)
    with pytest.raises(ValueError, match="needs trust_remote_code"):
        load_decoder(source)
    assert check_decoder(source, trust_remote_code=True).model_type == "llama"


@pytest.mark.parametrize("kind", ["gpt2", "t5", "bert"])
def test_refuses_other_architectures(kind: str, tmp_path: Path) -> None:
    """GPT-2 (Conv1D), T5 (encoder-decoder), BERT (encoder) refused from config.json alone,
    naming the supported list."""
    from transformers import BertConfig, GPT2Config, T5Config

    config = {"gpt2": GPT2Config(n_layer=1, n_embd=32, n_head=2),
              "t5": T5Config(num_layers=1, d_model=32, num_heads=2),
              "bert": BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2)}[kind]
    why = {"gpt2": "projects with GPT-2's Conv1D, not nn.Linear",
           "t5": "is an encoder-decoder, not a causal decoder",
           "bert": r"\(architectures: none\) is not a causal decoder transformers loads as "
                   "AutoModelForCausalLM"}[kind]
    source = resolve_model(_folder(tmp_path, config))
    with pytest.raises(ValueError, match=rf"model_type '{kind}' {why}; supported: "
                                         + ", ".join(ARCHITECTURES)):
        check_decoder(source)


def test_other_causal_decoder_accepted(tmp_path: Path, tokenizer: Any) -> None:
    """A causal decoder outside the tested list whose projections are nn.Linear (GPT-NeoX's
    fused query_key_value) is accepted, marked untested, and loads exactly."""
    from transformers import AutoModelForCausalLM, GPTNeoXConfig

    config = GPTNeoXConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                           intermediate_size=128, vocab_size=256)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(str(tmp_path / "neox"))
    tokenizer.save_pretrained(str(tmp_path / "neox"))
    info = check_decoder(resolve_model(tmp_path / "neox"))
    assert (info.model_type, info.architectures, info.tested) == (
        "gpt_neox", ("GPTNeoXForCausalLM",), False)
    loaded, _ = load_decoder(info.source)
    ids = _ids(tokenizer)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_check_projections_refuses_conv1d() -> None:
    """The after-load check: a loaded GPT-2's Conv1D projections are named."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel: block 0's attn.c_attn is a Conv1D, "
                                         r"not nn.Linear"):
        check_projections(gpt2)
    check_projections(tiny_model("phi3"))  # fused qkv_proj / gate_up_proj: nn.Linear


def test_refuses_link_out_of_the_cache(tmp_path: Path, tokenizer: Any) -> None:
    """A snapshot's link that leaves its repository's blobs/ is refused in one line, before
    anything is loaded; a link into its blobs is read."""
    snap = save_hf_cache(tiny_model("qwen2"), tokenizer, tmp_path / "hub")
    outside = tmp_path / "secret.txt"
    outside.write_text("not a model file")
    (snap / "README.md").symlink_to(outside)
    source = resolve_model(snap)
    with pytest.raises(CheckpointError, match=r"1 entry nvfp4lab will not read \(README.md -> "
                                              rf"{outside} \(outside the checkpoint folder\)\)") \
            as info:
        check_decoder(source)
    assert "\n" not in str(info.value)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        load_decoder(source)


def test_refuses_tokenizer_past_the_vocabulary(tmp_path: Path, tokenizer: Any) -> None:
    with pytest.raises(ValueError, match=r"^the tokenizer has 101 token ids \(0..100\) but the "
                                         r"model's vocabulary has 64 rows"):
        check_tokenizer(tokenizer, 64)
    check_tokenizer(tokenizer, 101)
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama")
    config.vocab_size = 64
    folder = tmp_path / "small-vocab"
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    with pytest.raises(ValueError, match=r"has 101 token ids .* vocabulary has 64 rows"):
        load_decoder(resolve_model(folder))


# ---------------------------------------------------------------------------------------------
# SmolLM2: the shipped model, and its GGUF file as a user's


@needs_smollm2
def test_smollm2_default_and_as_gguf(smollm2: tuple[Any, Any], cache: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    reference, reference_tokenizer = smollm2
    monkeypatch.setenv(settings.CACHE_ENV, str(cache))
    default = resolve_model(None)
    assert default == ModelSource(ModelKind.SMOLLM2, models.smollm2_path(cache).absolute(),
                                  local_models.SMOLLM2_NAME)
    gguf_file, _ = models._smollm2_gguf()
    source = resolve_model(str(gguf_file))
    assert source == ModelSource(ModelKind.GGUF, gguf_file.resolve(), gguf_file.name)
    info = check_decoder(source)
    assert (info.model_type, info.layers, info.hidden, info.heads, info.kv_heads, info.head_dim,
            info.vocab, info.dtype, info.parameters, info.tied) == (
        "llama", 30, 576, 9, 3, 64, 49152, "float32",
        sum(p.numel() for p in reference.parameters()), True)
    model, tokenizer = load_decoder(source)
    assert getattr(model, SOURCE_ATTRIBUTE) == gguf_file.resolve()
    ids = torch.tensor([reference_tokenizer("NVFP4 stores 16 values per block.")["input_ids"]])
    assert tokenizer("NVFP4 stores 16 values per block.")["input_ids"] == ids[0].tolist()
    assert torch.equal(_logits(model, ids), _logits(reference, ids))


def test_a_local_sentence_encoder_loads_as_notebook_05_uses_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer: Any) -> None:
    """A tiny BERT in the HF cache layout, by ``org/name``: its embeddings equal the in-memory
    model's mean-pooled, normalized output on the same tokens; decoders and GGUF files are
    refused in one line."""
    from transformers import BertConfig, BertModel

    from nvfp4lab.local_models import load_encoder
    from nvfp4lab.models import mean_pool
    from tests.checkpoint.hf_cache import hf_cache_layout

    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64)
    bert = BertModel(config).eval()
    saved = tmp_path / "bert"
    bert.save_pretrained(saved)
    tokenizer.save_pretrained(saved)
    hf_cache_layout(saved, tmp_path / "hub", repo_id="tiny-org/tiny-bert", revision="b" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    encoder = load_encoder("tiny-org/tiny-bert")
    sentences = ["the cat sat on the mat", "rain"]
    batch = encoder.tokenize(sentences)
    with torch.no_grad():
        want = torch.nn.functional.normalize(
            mean_pool(bert(**batch).last_hidden_state, batch["attention_mask"]), dim=-1)
    assert torch.equal(encoder.encode(sentences), want)
    with pytest.raises(ValueError, match="model_type 'llama' is not a sentence encoder"):
        llama = save_hf_cache(tiny_model("llama"), tokenizer, tmp_path / "hub2",
                              repo_id="tiny-org/tiny-llama")
        load_encoder(llama)
    with pytest.raises(ValueError, match="needs a model folder or org/name"):
        load_encoder(None)  # type: ignore[arg-type]
