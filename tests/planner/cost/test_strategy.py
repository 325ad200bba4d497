"""LayerStrategy validation and order normalisation, proto round trip, model-state formats."""

from __future__ import annotations

import pytest

from ballast.v1 import common_pb2, plan_pb2
from services.planner.cost import BYTES_PER_PARAM, Dim, LayerStrategy, ModelStateFormat
from services.planner.cost.strategy import model_state_bytes
from tests.cost_support import layer


def test_defaults_and_devices() -> None:
    st = LayerStrategy(dp=2, tp=4)
    assert st.devices == 8
    assert st.batch_split == 2
    assert st.order == (Dim.DP, Dim.TP)  # default nesting: TP innermost
    assert LayerStrategy().order == ()
    assert LayerStrategy().describe() == "single"
    assert LayerStrategy(sdp=2, tp=2, checkpoint=True).describe() == "sdp2xtp2 +ckpt"


def test_order_is_normalised_and_validated() -> None:
    assert LayerStrategy(dp=2, tp=2, order=("tp", "dp")).order == (Dim.TP, Dim.DP)
    # Dimensions of degree 1 are dropped.
    assert LayerStrategy(dp=2, order=(Dim.TP, Dim.DP, Dim.SDP)).order == (Dim.DP,)
    assert LayerStrategy(dp=2, order=(Dim.TP, Dim.DP)) == LayerStrategy(dp=2)
    with pytest.raises(ValueError, match="lacks"):
        LayerStrategy(dp=2, tp=2, order=(Dim.DP,))
    with pytest.raises(ValueError, match="repeats"):
        LayerStrategy(dp=2, order=(Dim.DP, Dim.DP))
    with pytest.raises(ValueError):
        LayerStrategy(dp=0)
    with pytest.raises(ValueError):
        LayerStrategy(tp=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        LayerStrategy(order=("pp",))  # type: ignore[arg-type]


def test_layout_ignores_checkpoint_and_swap() -> None:
    assert LayerStrategy(dp=2).layout == LayerStrategy(dp=2, checkpoint=True, swap=True).layout
    assert LayerStrategy(dp=2, tp=2).layout != LayerStrategy(dp=2, tp=2, order=(Dim.TP, Dim.DP)).layout


def test_proto_round_trip() -> None:
    msg = plan_pb2.LayerStrategy(
        layer_index=3, stage_index=1, dp=2, sdp=0, tp=4,
        order=[common_pb2.PARALLEL_DIM_PP, common_pb2.PARALLEL_DIM_TP, common_pb2.PARALLEL_DIM_DP],
        checkpoint=True, swap_activations=True,
    )
    st = LayerStrategy.from_proto(msg)
    assert st == LayerStrategy(dp=2, tp=4, order=(Dim.TP, Dim.DP), checkpoint=True, swap=True)
    back = st.to_proto(3, 1)
    assert list(back.order) == [common_pb2.PARALLEL_DIM_TP, common_pb2.PARALLEL_DIM_DP]
    assert (back.dp, back.sdp, back.tp, back.checkpoint, back.swap_activations) == (2, 1, 4, True, True)
    assert LayerStrategy.from_proto(plan_pb2.LayerStrategy()) == LayerStrategy()


def test_model_state_formats() -> None:
    assert sum(BYTES_PER_PARAM[ModelStateFormat.FP32_ADAM]) == 16
    assert sum(BYTES_PER_PARAM[ModelStateFormat.MIXED_ADAM]) == 16
    lv = layer(0, params=1000)
    assert model_state_bytes(lv, ModelStateFormat.FP32_ADAM) == (4000, 4000, 8000)
    assert model_state_bytes(lv, ModelStateFormat.MIXED_ADAM) == (2000, 2000, 12000)
    assert model_state_bytes(lv, ModelStateFormat.MEASURED) == (4000, 4000, 8000)
