"""The profiler remembers what a caller read of things the store never changes (a stored model, an analytical
profile), so a worker preparing many jobs of one model asks the store once, not twice per job; what one tenant's
token read is never answered to another's (services/profiler/runner.py, Runner._lookups)."""

from __future__ import annotations

import pytest

from ballast.v1 import model_pb2, services_pb2, store_pb2
from services.profiler.runner import Runner
from services.runtime import context
from services.runtime.errors import NotFound
from tests.store_fixtures import Store


class AsCaller:
    """The profiler's store as its caller (remote_stores' as_caller): the call context's token picks who asks;
    counts the calls that reach the store."""

    def __init__(self, store: Store):
        self._store, self.calls = store, []

    def __getattr__(self, name):
        token = context.caller_token()
        who = next(p for p in (self._store.a, self._store.b) if self._store.tokens[p.tenant_id] == token)
        method = getattr(self._store.as_(who), name)

        def counted(*args, **kw):
            self.calls.append(name)
            return method(*args, **kw)
        return counted


def as_tenant(store: Store, who) -> None:
    context.set_call(who, None, store.tokens[who.tenant_id])


@pytest.mark.parametrize("store_backend", ["sqlite", "remote"], indirect=True)
def test_a_stored_model_and_its_analytical_profile_are_read_once_per_caller(store: Store):
    model = store.as_(store.a).create_model(store_pb2.CreateModelRequest(spec=model_pb2.ModelSpec(
        name="gpt-remembered", family=model_pb2.MODEL_FAMILY_GPT,
        transformer=model_pb2.TransformerConfig(num_layers=2, hidden_size=32, num_heads=2, vocab_size=64,
                                                seq_length=16))))
    caller = AsCaller(store)
    runner = Runner(caller)
    ask = services_pb2.ProfileRequest(model_id=model.id, analytical=True, device_kind="A100-80GB",
                                      max_micro_batch_size=4)
    try:
        as_tenant(store, store.a)
        first = runner.analytical(ask)
        assert caller.calls == ["get_model", "list_profiles", "create_profile"]
        again = runner.analytical(ask)
        assert caller.calls == ["get_model", "list_profiles", "create_profile"]  # nothing more asked
        assert again.cached and again.profile == first.profile

        fresh = Runner(caller)  # another profiler process finds the stored profile, then remembers it
        assert fresh.analytical(ask).profile.id == first.profile.id
        assert caller.calls[3:] == ["get_model", "list_profiles"]

        as_tenant(store, store.b)  # another tenant's token: asked again, and refused as the store refuses it
        with pytest.raises(NotFound):
            runner.analytical(ask)
        assert caller.calls[5:] == ["get_model"]

        as_tenant(store, store.a)
        refreshed = runner.analytical(services_pb2.ProfileRequest(
            model_id=model.id, analytical=True, device_kind="A100-80GB", max_micro_batch_size=4, refresh=True))
        assert refreshed.profile.id != first.profile.id
        assert runner.analytical(ask).profile.id == refreshed.profile.id  # the newest is what is remembered
    finally:
        context.set_call(None, None)
