"""The Ray Serve LLM application for P/D with our connector: the ``import_path`` of
``configs/ray/serve_pd.yaml`` (``vllm_hybrid_nixl.deploy.ray.serve:build_pd_openai_app``)."""

from __future__ import annotations

from typing import Any

from vllm_hybrid_nixl.connector.ray_serve import register_ray_serve_backends


def build_pd_openai_app(pd_serving_args: dict[str, Any]) -> Any:
    """``ray.serve.llm.build_pd_openai_app`` with our connector registered first; the
    ``import_path`` of a Serve config."""
    if not register_ray_serve_backends():
        raise ImportError(
            "Ray Serve LLM is not importable here; install ray[serve,llm] (or ray[serve] and "
            "the Ray LLM requirements besides vLLM) next to vLLM"
        )
    from ray.serve.llm import build_pd_openai_app as build_with_ray

    return build_with_ray(pd_serving_args)
