"""Memory plans checked against figures computed by hand from the configs."""

import dataclasses

import pytest

from orca_jax.config import ConfigError, ParallelConfig, load_model_preset
from orca_jax.model.decoder import abstract_decoder
from orca_jax.parallel import mesh
from orca_jax.parallel.memory_plan import RESERVE_FRACTION, _flat_params, param_shapes, plan_memory

GiB = 1 << 30


def test_one_layer_shortcut_matches_the_full_abstract_decoder():
    for name in ("tiny", "tiny-gpt"):
        for tied in (True, False):
            model = dataclasses.replace(load_model_preset(name), n_layers=3, tie_word_embeddings=tied)
            assert sorted(param_shapes(model)) == sorted(_flat_params(abstract_decoder(model)))


def test_gpt3_13b_fits_one_40gib_device():
    model = load_model_preset("gpt3-13b")
    plan = plan_memory(model, ParallelConfig(), page_size=16, device_memory=40 * GiB)
    # ~12.85e9 parameters x 2 bytes (bf16) = 25.7e9 bytes, all on the one device.
    assert plan.param_bytes == pytest.approx(model.num_params() * 2, rel=0.01)
    assert plan.param_bytes == pytest.approx(25.7e9, rel=0.01)
    # 40 layers x K,V x 16 tokens x 40 heads x 128 x 2 bytes = 12.5 MiB per page.
    assert plan.kv_bytes_per_page == 40 * 2 * 16 * 40 * 128 * 2 == 12.5 * 2**20
    assert plan.reserve_bytes == int(40 * GiB * RESERVE_FRACTION)
    assert plan.num_pages == (40 * GiB - plan.reserve_bytes - plan.param_bytes) // plan.kv_bytes_per_page
    assert plan.num_tokens == plan.num_pages * 16
    assert plan.num_full_sequences == plan.num_pages // (2048 // 16) >= 7
    assert f"{plan.num_pages} pages" in plan.summary() and f"{plan.num_tokens} tokens" in plan.one_line()


def test_gpt3_175b_fits_tp8_pp2_on_40gib_devices(monkeypatch):
    # The tensor-parallel table the runner is moving to: the vocabulary is split over tp too.
    monkeypatch.setitem(mesh.LOGICAL_AXIS_RULES, "vocab", "tp")
    model = load_model_preset("gpt3-175b")
    d, v, tp = model.d_model, model.vocab_size, 8
    plan = plan_memory(model, ParallelConfig(tensor_parallel_size=8, pipeline_parallel_size=2),
                       page_size=16, device_memory=40 * GiB)
    assert [s.layers for s in plan.stages] == [range(0, 48), range(48, 96)]
    # Per layer: kernels (4 d^2 attention + 8 d^2 MLP) and the q/k/v and up biases (3d + 4d) split
    # over tp; the o and down biases and two LayerNorms (6d) replicated. The first stage, the
    # largest, adds its 1/tp of the (tied) embedding and the whole position table.
    layer = (12 * d * d + 7 * d) // tp + 6 * d
    first_stage = 48 * layer + v * d // tp + model.max_position * d
    assert plan.param_bytes == plan.stages[0].param_bytes == 2 * first_stage
    assert plan.stages[1].param_bytes == 2 * (48 * layer + v * d // tp + 2 * d)
    # Against 175e9 / 16 devices: the replicated parts (position table, norms, biases) and the tied
    # head that both ends hold add 0.6%, inside a 1% tolerance.
    assert plan.param_bytes == pytest.approx(2 * model.num_params() / 16, rel=0.01)
    # 48 layers x K,V x 16 tokens x 96/8 heads x 128 x 2 bytes = 4.5 MiB per page.
    assert plan.kv_bytes_per_page == 48 * 2 * 16 * 12 * 128 * 2
    assert plan.num_pages == (40 * GiB - plan.reserve_bytes - plan.param_bytes) // plan.kv_bytes_per_page
    assert plan.num_full_sequences >= 20


def test_the_plan_follows_the_rules_table(monkeypatch):
    model = load_model_preset("smollm2-135m-instruct")
    parallel = ParallelConfig(tensor_parallel_size=3)
    monkeypatch.setitem(mesh.LOGICAL_AXIS_RULES, "vocab", None)
    replicated = plan_memory(model, parallel, page_size=16, kv_cache_memory=GiB).param_bytes
    monkeypatch.setitem(mesh.LOGICAL_AXIS_RULES, "vocab", "tp")
    split = plan_memory(model, parallel, page_size=16, kv_cache_memory=GiB).param_bytes
    embedding = model.vocab_size * model.d_model * 4
    assert replicated - split == embedding - embedding // 3


def test_gpt3_175b_on_one_40gib_device_is_refused_naming_the_shortfall():
    model = load_model_preset("gpt3-175b")
    with pytest.raises(ConfigError) as err:
        plan_memory(model, ParallelConfig(), page_size=16, device_memory=40 * GiB)
    message = str(err.value)
    # ~349 GB of bf16 parameters + a 4 GiB reserve on a 40 GiB device: ~289 GiB short.
    short = (2 * model.num_params() + 4 * GiB - 40 * GiB) / GiB
    assert f"short by {short:.2f} GiB per device" in message
    assert "tensor_parallel_size" in message and "pipeline_parallel_size" in message


def test_tiny_at_tp2_splits_kv_heads_and_tp4_is_refused():
    model = load_model_preset("tiny")  # 2 layers, 2 KV heads, head_dim 16, float32
    plan = plan_memory(model, ParallelConfig(tensor_parallel_size=2), page_size=16, kv_cache_memory=2**20)
    assert plan.kv_heads == 2
    assert plan.kv_bytes_per_page == 2 * 2 * 16 * 1 * 16 * 4
    assert plan.num_pages == 2**20 // plan.kv_bytes_per_page == 256
    with pytest.raises(ConfigError, match="vocab_size=66.*tp 1 or 2"):
        plan_memory(model, ParallelConfig(tensor_parallel_size=4), page_size=16, kv_cache_memory=2**20)


def test_smollm2_tp2_is_refused_naming_1_or_3():
    model = load_model_preset("smollm2-135m-instruct")
    with pytest.raises(ConfigError, match="tp 1 or 3"):
        plan_memory(model, ParallelConfig(tensor_parallel_size=2), page_size=16, kv_cache_memory=GiB)


def test_replicated_kv_heads_cost_what_native_ones_do():
    gqa = dataclasses.replace(load_model_preset("tiny"), vocab_size=64, n_heads=8, n_kv_heads=2, head_dim=8,
                              bos_token_id=None, eos_token_id=None)
    parallel = ParallelConfig(tensor_parallel_size=4)
    replicated = plan_memory(gqa, parallel, page_size=16, kv_cache_memory=2**20)
    native = plan_memory(dataclasses.replace(gqa, n_kv_heads=4), parallel, page_size=16, kv_cache_memory=2**20)
    assert replicated.kv_heads == 4
    assert replicated.stages == native.stages


def test_one_device_plan_counts_pages_by_hand():
    model = load_model_preset("smollm2-135m-instruct")
    plan = plan_memory(model, ParallelConfig(), page_size=16, kv_cache_memory=GiB)
    page_bytes = 30 * 2 * 16 * 3 * 64 * 4  # layers x (K, V) x tokens x KV heads x head_dim x float32
    assert plan.kv_bytes_per_page == page_bytes and plan.num_pages == GiB // page_bytes == 1456
    assert plan.param_bytes == model.num_params() * 4


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_stages_hold_every_parameter_once_except_a_tied_head(tied):
    model = dataclasses.replace(load_model_preset("tiny-gpt"), n_layers=3, tie_word_embeddings=tied)
    plan = plan_memory(model, ParallelConfig(pipeline_parallel_size=2), page_size=16, kv_cache_memory=2**20)
    assert [s.layers for s in plan.stages] == [range(0, 2), range(2, 3)]
    duplicated_head = model.vocab_size * model.d_model * 4 if tied else 0
    assert sum(s.param_bytes for s in plan.stages) == model.num_params() * 4 + duplicated_head
    assert [s.kv_bytes_per_page for s in plan.stages] == [n * 2 * 16 * 4 * 16 * 4 for n in (2, 1)]


def test_kv_that_cannot_hold_one_sequence_is_refused():
    model = load_model_preset("gpt3-13b")
    refusal = r"less than one sequence of max_model_len=2048; short by 1.46 GiB per device"
    with pytest.raises(ConfigError, match=refusal):
        plan_memory(model, ParallelConfig(), page_size=16, kv_cache_memory=100 * 2**20)
    # A shorter context fits the same 100 MiB: 8 pages x 16 tokens.
    plan = plan_memory(model, ParallelConfig(), page_size=16, kv_cache_memory=100 * 2**20, max_model_len=128)
    assert plan.num_pages == 8 and plan.num_full_sequences == 1


def test_kv_memory_beside_parameters_must_fit_the_device():
    model = load_model_preset("gpt3-13b")
    with pytest.raises(ConfigError, match="short by .* GiB per device; lower kv_cache_memory to 12.06 GiB"):
        plan_memory(model, ParallelConfig(), page_size=16, device_memory=40 * GiB, kv_cache_memory=20 * GiB)


def test_bad_requests_are_refused():
    tiny = load_model_preset("tiny")
    with pytest.raises(ConfigError, match="exceeds 'tiny'.s context length 128"):
        plan_memory(tiny, ParallelConfig(), page_size=16, max_model_len=129, kv_cache_memory=2**20)
    with pytest.raises(ConfigError, match="give device_memory .* or kv_cache_memory"):
        plan_memory(tiny, ParallelConfig(), page_size=16)


def test_dtype_override_halves_float32_parameters():
    tiny = load_model_preset("tiny")
    f32 = plan_memory(tiny, ParallelConfig(), page_size=16, kv_cache_memory=2**20)
    bf16 = plan_memory(tiny, ParallelConfig(), page_size=16, kv_cache_memory=2**20, dtype="bfloat16")
    assert bf16.dtype == "bfloat16" and 2 * bf16.param_bytes == f32.param_bytes
    assert 2 * bf16.kv_bytes_per_page == f32.kv_bytes_per_page


def test_the_kv_pages_follow_the_memory_utilization_and_a_shortfall_names_it():
    model = load_model_preset("gpt3-13b")  # 23.9 GiB of bf16 parameters on one device
    plans = {f: plan_memory(model, ParallelConfig(), page_size=16, device_memory=40 * GiB, memory_utilization=f)
             for f in (0.7, 0.9, 0.95)}
    for f, plan in plans.items():
        usable = int(40 * GiB * f)
        assert plan.reserve_bytes == 40 * GiB - usable
        assert plan.num_pages == (usable - plan.param_bytes) // plan.kv_bytes_per_page
        assert f"of {f:g} x 40.00 GiB per device" in plan.one_line()
    assert plans[0.7].num_pages < plans[0.9].num_pages < plans[0.95].num_pages
    with pytest.raises(ConfigError, match=r"memory utilization 0.5: parameters need 23.9\d GiB per device plus a "
                                          r"20.00 GiB reserve, short by 3.9\d GiB per device.*raise the memory"):
        plan_memory(model, ParallelConfig(), page_size=16, device_memory=40 * GiB, memory_utilization=0.5)
    with pytest.raises(ConfigError, match="must be in"):
        plan_memory(model, ParallelConfig(), page_size=16, device_memory=40 * GiB, memory_utilization=1.5)
