"""`/v1/models`: the one model the running engine serves."""

from __future__ import annotations

from server.lifecycle.holder import EngineHolder
from server.protocol.openai import ModelCard, ModelList


def list_models(holder: EngineHolder) -> ModelList:
    engine = holder.engine
    settings = holder.settings
    card = ModelCard(
        id=settings.served_model_name,
        root=engine.info.model_path if engine else settings.model_path(),
        max_model_len=engine.info.max_model_len if engine else settings.engine.max_model_len,
    )
    return ModelList(data=[card])
