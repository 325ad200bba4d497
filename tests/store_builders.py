"""Proto builders the store tests share: small, valid messages a test then bends out of shape.

Plain functions, not fixtures, so a test reads what it sends; kept out of the test files so no
test module imports another.
"""

from __future__ import annotations

from ballast.v1 import common_pb2, fleet_pb2, job_pb2, model_pb2, plan_pb2, profile_pb2


def gpt(name: str = "gpt-tiny", layers: int = 2, hidden: int = 64) -> model_pb2.ModelSpec:
    return model_pb2.ModelSpec(
        name=name,
        family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(
            num_layers=layers, hidden_size=hidden, num_heads=4, vocab_size=128, seq_length=32
        ),
    )


def job_spec(name: str = "train", model: model_pb2.ModelSpec | None = None, **fields) -> job_pb2.JobSpec:
    return job_pb2.JobSpec(name=name, model=model or gpt(), global_batch_size=8, iterations=10, **fields)


def host(name: str, kinds: list[str], **kw) -> fleet_pb2.Host:
    return fleet_pb2.Host(
        name=name,
        address=f"{name}:29500",
        agent_port=50060,
        agent_version="0.1.0",
        labels={"zone": "z1"},
        supported_parallelism=[common_pb2.PARALLEL_DIM_DP, common_pb2.PARALLEL_DIM_PP],
        devices=[
            fleet_pb2.Device(index=i, uuid=f"u{i}", spec=fleet_pb2.DeviceSpec(kind=k, memory_bytes=1 << 34))
            for i, k in enumerate(kinds)
        ],
        **kw,
    )


def profile_msg(model_id: str, kind: str = "cpu", layers: int = 2) -> profile_pb2.Profile:
    pr = profile_pb2.Profile(
        model_id=model_id,
        device=fleet_pb2.DeviceSpec(kind=kind, memory_bytes=8 << 30, peak_flops=1e12),
        dtype=common_pb2.DTYPE_FP32,
        software="torch 2.13.0",
        intra_op_threads=2,
        non_model_memory_bytes=123,
        comm=profile_pb2.CommCalibration(
            links=[
                profile_pb2.LinkSample(scope=profile_pb2.LINK_SCOPE_INTRA_NODE, bytes=1 << 20, seconds=0.001)
            ],
            overlap_slowdown=1.2,
        ),
    )
    for i in range(layers):
        pr.layers.add(
            index=i,
            name=f"block.{i}",
            kind="block",
            parameter_count=1000 + i,
            parameter_bytes=4000,
            gradient_bytes=4000,
            optimizer_state_bytes=8000,
            extra_inputs=[0] if i else [],
            tied_with=[],
            samples=[
                profile_pb2.LayerSample(
                    micro_batch_size=mbs, measured=True, forward_s=0.01 * mbs, backward_s=0.02
                )
                for mbs in (1, 2, 4)
            ],
        )
    return pr


def plan_msg(model_id: str, *, job_id: str = "", profile_id: str = "", layers: int = 2) -> plan_pb2.Plan:
    pl = plan_pb2.Plan(
        model_id=model_id,
        job_id=job_id,
        profile_id=profile_id,
        engine=plan_pb2.PLAN_ENGINE_GALVATRON,
        global_batch_size=8,
        micro_batch_size=2,
        num_micro_batches=4,
        schedule=plan_pb2.SCHEDULE_1F1B,
        fleet=fleet_pb2.Fleet(
            name="cpu2", device=fleet_pb2.DeviceSpec(kind="cpu"), devices_per_node=2, nodes=1
        ),
        stages=[
            plan_pb2.Stage(index=0, layer_begin=0, layer_end=1, devices=1, predicted_time_s=0.5),
            plan_pb2.Stage(index=1, layer_begin=1, layer_end=layers, devices=1, predicted_time_s=0.5),
        ],
        prediction=plan_pb2.Prediction(
            iteration_time_s=2.0, throughput_samples_per_s=4.0, peak_memory_bytes=1 << 30
        ),
        explanation="balanced two-stage pipeline",
        memory_budget_bytes=8 << 30,
        alternatives=[
            plan_pb2.PlanAlternative(
                name="DDP",
                engine=plan_pb2.PLAN_ENGINE_BASELINE,
                global_batch_size=8,
                reason="out of memory",
                prediction=plan_pb2.Prediction(iteration_time_s=3.0, out_of_memory=True),
            )
        ],
    )
    for i in range(layers):
        pl.layers.add(
            layer_index=i,
            stage_index=min(i, 1),
            dp=1,
            sdp=1,
            tp=1,
            order=[common_pb2.PARALLEL_DIM_DP],
            checkpoint=i == 0,
        )
    return pl


def detailed_profile_msg(model_id: str, kind: str = "cpu") -> profile_pb2.Profile:
    """profile_msg with every field added in 0004 and 0020 (and CommCalibration's fits/unsupported) set."""
    pr = profile_msg(model_id, kind=kind, layers=3)
    pr.memory_trace.extend(
        profile_pb2.MemoryTracePoint(op_index=i, op=op, layer=layer, phase=phase, non_model_bytes=size)
        for i, (op, layer, phase, size) in enumerate(
            [
                ("aten::embedding", "embed", "forward", 1 << 20),
                ("aten::mm", "block.0", "backward", (1 << 63) - 1),
                ("aten::add_", "", "optimizer", 0),
            ]
        )
    )
    pr.measured_micro_batch_sizes.extend([1, 4])
    pr.memory_cap_bytes = (1 << 63) - 1
    pr.profiling_time_s = 12.5
    pr.composition_factor, pr.host_noise, pr.noisy, pr.measure_passes = 1.125, 0.3125, True, 2  # 0020
    pr.layers[0].samples[0].forward_spread, pr.layers[0].samples[0].backward_spread = 0.0625, 0.09375
    pr.comm.fits.add(
        collective="allreduce", group_size=2, latency_s=1e-5, bandwidth_bytes_per_s=2e9,
        bus_bandwidth_bytes_per_s=2e9, r2=0.999,
    )  # fmt: skip
    pr.comm.fits.add(collective="p2p", group_size=2)  # a fit with no positive slope keeps its zeros
    pr.comm.unsupported.extend(["reduce_scatter@2: not supported by gloo", "all_to_all@2: ✗"])
    pr.layers[0].note = "does not fit at micro-batch 8: out of memory ✗"
    pr.layers[0].measured_as = 0
    pr.layers[0].batch_input_bytes = 256
    pr.layers[0].max_micro_batch_size = 4
    pr.layers[1].measured_as = 1
    pr.layers[1].max_micro_batch_size = 2**31 - 1
    pr.layers[1].tensor_parallel = 4  # a block the executors can split 2 or 4 ways
    pr.layers[1].sequence_parallel = 2  # ... its sequence 2 ways
    pr.layers[2].measured_as = 1  # reused layer 1's rows
    pr.layers[2].batch_input_bytes = (1 << 63) - 1
    del pr.layers[2].samples[:]
    pr.layers[2].note = "reused block.1"
    return pr


def page(size: int, token: str = "") -> common_pb2.PageRequest:
    return common_pb2.PageRequest(page_size=size, page_token=token)
