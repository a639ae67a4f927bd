"""Stop rules: when a sequence ends, as pure functions of the request and its last token.

Nothing here changes a request; the caller appends the token first and retires the
request on a status.
"""

from __future__ import annotations

from engine.request import Request, RequestStatus


def is_stop_token(request: Request, token: int) -> bool:
    """A stop token id, or EOS unless the request ignores it."""
    params = request.sampling_params
    return token in params.stop_token_ids or (
        not params.ignore_eos and token in request.eos_token_ids
    )


def stop_status(
    request: Request, token: int, max_model_len: int, grammar_completed: bool = False
) -> RequestStatus | None:
    """The status ``token`` (already appended) ends the sequence with, or None.

    EOS (unless ignore_eos) or a stop token id ends it once ``min_tokens`` are out, and a
    completed grammar always does; max_tokens and ``max_model_len`` cut it at length."""
    params = request.sampling_params
    num_output = len(request.output_token_ids)
    if grammar_completed:
        return RequestStatus.FINISHED_STOPPED
    if num_output > params.min_tokens and is_stop_token(request, token):
        return RequestStatus.FINISHED_STOPPED
    if num_output >= params.max_tokens or len(request.all_token_ids) >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def prefill_done(request: Request) -> bool:
    """A ``max_tokens`` 0 request (prefill only) ends once its prompt is computed."""
    return (
        request.sampling_params.prefill_only
        and request.num_computed_tokens >= request.num_prompt_tokens
    )
