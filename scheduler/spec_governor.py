"""Whether a step drafts: where, by what the engine has measured, drafting pays.

Verifying a draft token costs a row of the forward pass. While a step is bound by reading the
weights (a few rows on a CPU, hundreds on a GPU) that row is nearly free; once the step is bound
by arithmetic it costs as much as any other row, and a draft token kept half the time then
halves what its row delivers. Where the line falls depends on the device, the model and the
contexts, so it is measured, not modelled. The scheduler process times each decode-only step
from its plan to its result. A plain step of B decodes teaches what B decodes cost (a moving
average per B); a drafted step of B decodes is compared with that cost: its tokens per second
over the plain step's B / seconds at the same B, a gain whose moving average is kept per class
of batch size (powers of two). A class drafts until `TRUSTED` drafted steps have measured it
(unless the first gain is hopeless), then while its gain is at least `MARGIN`; every
`EXPLORE`-th step of a drafting class does not, and every 4 * `EXPLORE`-th step of another
drafts, so both figures stay current (longer contexts, other requests). A size measures its
plain steps first; a class without a gain of its own takes the nearest class's. (With a draft
model, a step that only measures (`trying`: a class not known to pay, or not measured
`TRUSTED` times) drafts one request only, the one drafted latest: the draft has not followed
the others' tokens while they were not drafted, and computing them all would cost what the
measurement is meant to avoid; a try whose step only caught its request up measured nothing,
and the next step of the class tries again, `retry`.)
"""

from __future__ import annotations

EXPLORE = 16  # every this many steps of a class, the choice its figures do not favour
EMA = 0.2  # weight of a new step in a figure
# Drafting must beat not drafting by this much: steps timed on a busy host are noisy, and a
# choice that flips on noise pays for the worse one; where drafting pays, it pays far more.
MARGIN = 1.05
# A class's own gain decides once this many drafted steps have measured it (it drafts until
# then): one step's proposals may all miss where most would not. A gain below `HOPELESS`
# over two steps decides then: no luck of the proposals makes up for what such steps cost
# (one step may be slow by chance on a busy host).
TRUSTED = 4
HOPELESS = 0.75


def size_class(num_decodes: int) -> int:
    """1, 2, 3-4, 5-8, ...: the power of two at or above the number of decodes."""
    return 1 << (max(1, num_decodes) - 1).bit_length()


class DraftSwitch:
    def __init__(self) -> None:
        self.plain: dict[int, float] = {}  # decodes -> seconds of a plain decode-only step
        self.plain_classes: set[int] = set()  # the classes of the sizes in `plain`
        self.gain: dict[int, float] = {}  # class -> drafted tokens/s over plain tokens/s, same size
        self.samples: dict[int, int] = {}  # class -> drafted steps measured
        self.steps: dict[int, int] = {}  # class -> steps decided
        self.trying = False  # the last choice drafts where drafting has not paid: a try
        self._again: int | None = None  # the class whose next step tries again
        self._class = 0  # the last choice's

    def plain_seconds(self, num_decodes: int) -> float | None:
        """What a plain step of `num_decodes` costs: its own figure, else the nearest size's."""
        if num_decodes in self.plain:
            return self.plain[num_decodes]
        if not self.plain:
            return None
        return self.plain[min(self.plain, key=lambda b: abs(b - num_decodes))]

    def choose(self, num_decodes: int) -> bool:
        """Whether a step with `num_decodes` decodes drafts; `trying` says whether the step only
        measures (a class not known to pay, or still being measured)."""
        c = self._class = size_class(num_decodes)
        n = self.steps[c] = self.steps.get(c, 0) + 1
        drafts, self.trying = self._decision(c, n)
        if self._again == c:
            self._again = None
        return drafts

    def would_draft(self, num_decodes: int) -> bool:
        """What `choose` would answer for the next step of `num_decodes` decodes (nothing changes)."""
        c = size_class(num_decodes)
        return self._decision(c, self.steps.get(c, 0) + 1)[0]

    def skip(self, num_decodes: int) -> None:
        """A step of `num_decodes` decodes that could not draft (planned while another ran, with
        async scheduling) counts among its class's steps, so that its tries still come round."""
        c = size_class(num_decodes)
        self.steps[c] = self.steps.get(c, 0) + 1

    def _decision(self, c: int, n: int) -> tuple[bool, bool]:
        """(drafts, trying) for the n-th step of class c."""
        if self._again == c:
            return True, True
        if c not in self.plain_classes:
            return False, False
        gain = self.gain.get(c)
        if gain is not None and self.samples[c] < TRUSTED and (self.samples[c] < 2 or gain >= HOPELESS):
            return True, True
        if gain is None:  # the nearest class's figure, if any, until this class has its own
            if not self.gain:
                return True, True
            gain = self.gain[min(self.gain, key=lambda k: abs(k.bit_length() - c.bit_length()))]
            if gain >= MARGIN:
                return True, True
        drafts = gain >= MARGIN
        # Drafted steps that do not pay are the costly ones to try: tried less often.
        trying = not drafts and n % (4 * EXPLORE) == 0
        return drafts != (n % (EXPLORE if drafts else 4 * EXPLORE) == 0), trying

    def retry(self) -> None:
        """The last choice's try measured nothing: the next step of its class tries again."""
        self._again = self._class

    def observe(self, num_decodes: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of `num_decodes` decodes delivered `tokens` in `seconds`."""
        if seconds <= 0:
            return
        if not drafted:
            old = self.plain.get(num_decodes)
            self.plain[num_decodes] = seconds if old is None else old + EMA * (seconds - old)
            self.plain_classes.add(size_class(num_decodes))
            return
        plain = self.plain_seconds(num_decodes)
        if plain is None:
            return
        c = size_class(num_decodes)
        gain = (tokens / seconds) / (num_decodes / plain)
        old = self.gain.get(c)
        self.gain[c] = gain if old is None else old + EMA * (gain - old)
        self.samples[c] = self.samples.get(c, 0) + 1
