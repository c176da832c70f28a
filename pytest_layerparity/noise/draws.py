"""The random draws of the perturbed runs' rounding (:mod:`.rounding`): 15 bits an element,
its lowest one a sign and the rest a place within an ulp. On the CPU a function of a key
drawn once per rounded result and of each element's place (:func:`counter_halves`), elsewhere
the device generator's own (:func:`random_halves`)."""

from __future__ import annotations

import sys

import torch


def random_halves(n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``n`` random 15-bit integers (int16), two per 31-bit draw of ``generator``: the low
    and the high half of each. Drawing a random number costs a perturbed op more than the
    arithmetic around it (2 to 7 ns an element on the CPU against 0.1 for a multiply), and an
    element needs one sign bit and a position within an ulp, not 32 or 64 random bits.
    Drawing n in blocks of an even size gives the same n as drawing them at once. Off the
    CPU, where the generator's one kernel is cheap (the CPU's: :func:`counter_halves`)."""
    raw = torch.empty((n + 1) // 2, dtype=torch.int32, device=device).random_(generator=generator)
    if sys.byteorder == "little":  # the halves in place, the low one first
        halves = raw.view(torch.int16).bitwise_and_(0x7FFF)
    else:
        halves = torch.stack((raw & 0x7FFF, raw >> 16), dim=-1).view(-1).to(torch.int16)
    return halves[:n] if halves.numel() != n else halves


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


#: SplitMix64's constants (its counter's step and its two multipliers), as int64.
_SPLITMIX = tuple(_signed64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def counter_key(generator: torch.Generator) -> int:
    """A result's key for :func:`counter_halves`: one 62-bit draw of ``generator`` (a run's
    generator moves by one draw per rounded result, whatever its size)."""
    return int(torch.randint(0, 1 << 62, (1,), generator=generator))


def counter_halves(key: int, start: int, stop: int) -> torch.Tensor:
    """The 15-bit draws (int16, as :func:`random_halves`) of a result's flat elements
    ``start`` to ``stop`` on the CPU, a function of the result's ``key``
    (:func:`counter_key`) and of each element's place: element e takes the four 15-bit
    fields of SplitMix64's output for counter e // 4 (its bits 0, 16, 32 and 48 up, in that
    order, e % 4 choosing). The CPU generator's draws come one after the other on one
    thread; these are a dozen integer passes on every thread (a 2^18-element block: 1.3 ns
    an element on two threads, 2.9 drawn from the generator), and any block of a result
    gets the draws it gets in the whole."""
    first, last = start // 4, -(-stop // 4)
    step, mix1, mix2 = _SPLITMIX
    z = torch.arange(first + 1, last + 1, dtype=torch.int64).mul_(step).add_(key)
    # shifts made logical by masking the sign's copies (torch shifts int64 arithmetically)
    z.bitwise_xor_((z >> 30).bitwise_and_((1 << 34) - 1)).mul_(mix1)
    z.bitwise_xor_((z >> 27).bitwise_and_((1 << 37) - 1)).mul_(mix2)
    z.bitwise_xor_((z >> 31).bitwise_and_((1 << 33) - 1))
    if sys.byteorder == "little":  # the four fields in place, the lowest first
        halves = z.view(torch.int16)
    else:
        halves = torch.stack([z >> shift for shift in (0, 16, 32, 48)], dim=-1).to(torch.int16).view(-1)
    return halves.bitwise_and_(0x7FFF)[start - 4 * first : stop - 4 * first]
