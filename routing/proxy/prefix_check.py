"""The prefix index's loop for one request: what it expects of the host, what the host says.

Before a request goes to its host, the index's prediction (how many leading blocks of its
prompt the host holds) goes on its trail; when the answer ends, so does the host's own word
(its cached tokens, in blocks), and the index is corrected by it and taught what the host
holds now. The row and the metrics compare the two (`accounting.report.is_cache_lost`). A
request without a prompt (`NO_PREFIX`) costs nothing here, and does not touch the index.
"""

from __future__ import annotations

from routing.core.tee import Usage
from routing.proxy.record import Trail
from routing.runtime import Runtime


def predicted(trail: Trail, runtime: Runtime) -> Trail:
    """`trail`, placed on its host, with the runtime's prefix index's prediction for it there."""
    chain = trail.prefix.blocks
    if not chain:
        return trail
    depth = runtime.prefixes.match(trail.host, trail.model, chain)
    return trail._replace(predicted_blocks=depth)


def settled(trail: Trail, runtime: Runtime, usage: Usage, status: int) -> Trail:
    """`trail` with the blocks the host reported cached, once its answer has ended.

    A host that reported fewer blocks than predicted is corrected at once: the index forgets
    its blocks of this prompt past the report. A host that answered (a status under 400) holds
    the whole prompt now, so the index learns it; a failed answer teaches nothing. Nothing
    changes when the host did not report its counts.
    """
    reported = trail.prefix.cached_blocks(usage.prompt_tokens, usage.cached_tokens)
    if reported is None:
        return trail
    chain, index = trail.prefix.blocks, runtime.prefixes
    if trail.predicted_blocks is not None and reported < trail.predicted_blocks:
        index.correct(trail.host, trail.model, chain, reported)
    if status < 400:
        index.learn(trail.host, trail.model, chain)
    return trail._replace(reported_blocks=reported)
