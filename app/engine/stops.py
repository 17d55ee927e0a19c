"""Stop strings matched across token boundaries.

Text is released only when it can no longer become part of a stop: any tail that is a prefix
of some stop string is held back until the next token settles it. The stop text itself is never
released.
"""


class StopMatcher:
    def __init__(self, stops):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add new text; returns (text safe to release, the stop that matched or None).
        After a match, everything from the stop on is dropped."""
        if not self.stops:
            return text, None
        buffer = self.held + text
        found = [(buffer.find(s), s) for s in self.stops]
        found = [(at, s) for at, s in found if at >= 0]
        if found:
            at, stop = min(found)
            self.held = ""
            return buffer[:at], stop
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buffer)), keep, -1):
                if s.startswith(buffer[-n:]):
                    keep = n
                    break
        self.held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], None

    def take_held(self) -> str:
        """What was held back, when generation ends for another reason."""
        held, self.held = self.held, ""
        return held
