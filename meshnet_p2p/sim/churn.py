"""How long peers stay: heavy-tailed online sessions and offline gaps.

Measurements of deployed P2P systems (Stutzbach and Rejaie, "Understanding Churn
in Peer-to-Peer Networks", IMC 2006, on Gnutella, Kad and BitTorrent; Steiner et
al., "Long Term Study of Peer Behavior in the KAD DHT", ToN 2009) find session
lengths far from exponential: most sessions are short, a few last days, and a
Weibull with shape well below 1 fits them. The shapes and medians here are
assumptions in that range (docs/scale.md), parameters of the run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass
class Churn:
    session_median_s: float = 3600.0  # half the sessions end within this
    gap_median_s: float = 3600.0  # and half the offline gaps
    shape: float = 0.5  # Weibull shape: < 1 is heavy-tailed (1 would be exponential)
    # Sessions that end with the machine vanishing (power or network gone: no FIN closes
    # its connections) rather than its process exiting. An assumption: the studies above
    # see departures, not how they happen. A hop that vanished costs a generation through
    # it the client's step timeout before it fails over.
    vanish_share: float = 0.0

    def _weibull(self, rng: random.Random, median: float) -> float:
        scale = median / math.log(2) ** (1 / self.shape)  # the scale whose median is ``median``
        return rng.weibullvariate(scale, self.shape)

    def session(self, rng: random.Random) -> float:
        return self._weibull(rng, self.session_median_s)

    def gap(self, rng: random.Random) -> float:
        return self._weibull(rng, self.gap_median_s)

    def online_at_start(self, rng: random.Random) -> bool:
        """In steady state a peer is online with the share of time its sessions take."""
        mean_on = self.session_median_s / math.log(2) ** (1 / self.shape) * math.gamma(1 + 1 / self.shape)
        mean_off = self.gap_median_s / math.log(2) ** (1 / self.shape) * math.gamma(1 + 1 / self.shape)
        return rng.random() < mean_on / (mean_on + mean_off)

    def remaining(self, rng: random.Random) -> float:
        """What is left of a session already under way when the run starts: longer
        sessions are more likely to be the ones under way (length-biased), and a
        uniform share of one is left."""
        longest = max(self.session(rng) for _ in range(2))
        return longest * rng.random()
