"""A star route: the client carries every hidden state itself, from each hop to
the next (two network crossings a hop). A hop that fails is replaced and the
step retried on the replacement. Only a star attests (certification)."""

from __future__ import annotations

from typing import Sequence

from meshnet_p2p.dataplane.stub import ShardConnectionError, ShardError
from meshnet_p2p.trust.attestation import Attestation, CertificationError

from .chain import Chain
from .failover import replace_hop


class StarRoute(Chain):

    def step(self, position: int, token_ids: Sequence[int], decode: bool):
        """One step through every hop; returns the tail's reply."""
        payload: object = tuple(token_ids)
        i = 0
        while i < len(self.hops):
            try:
                payload = self.through(self.hops[i], position, payload, decode)
            except (ShardConnectionError, ShardError) as e:
                replace_hop(self, i, e)
                continue  # retry this step on the replacement
            i += 1
        return payload

    def attestations(self) -> list[Attestation]:
        """Each hop's signed statement of what it computed, checked against what
        this client gave it and got back (raises CertificationError otherwise)."""
        if not self.opts.attest:
            raise CertificationError("this route session was not opened to attest (attest=True)")
        out = []
        for hop in self.hops:
            a = hop.stream.attestation(timeout=self.opts.step_timeout)
            seen = (hop.span.peer_id, hop.stream.session_id, hop.span.start, hop.span.end, hop.steps,
                    hop.inputs.hexdigest(), hop.outputs.hexdigest())
            if (a.peer_id, a.session_id, a.start, a.end, a.steps, a.input_digest, a.output_digest) != seen:
                raise CertificationError(f"{hop.span.peer_id} attests other work than this route gave it")
            if not a.verifies():
                raise CertificationError(f"{hop.span.peer_id}'s attestation signature does not verify")
            out.append(a)
        return out
