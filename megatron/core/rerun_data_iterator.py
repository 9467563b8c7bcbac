"""`RerunDataIterator`: a data iterator that can hand out the batches of the current iteration again, so that
the rerun state machine reruns a step on exactly the same data."""


class RerunDataIterator:
    """Wraps an iterator; records the batches drawn since the last `advance()` and replays them after `rewind()`.

    `advance()` starts a new iteration (forgets the recorded batches); `rewind()` makes the next `next()` calls
    return the recorded batches in order before drawing new ones from the wrapped iterator. Nothing is recorded
    before the first `advance()`: an iterator that no rerun state machine drives (`--rerun-mode disabled`,
    evaluation) holds no batch.
    """

    def __init__(self, iterable):
        self.iterable = iter(iterable)
        self._batches = []
        self._replay_position = None
        self._recording = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._replay_position is not None:
            if self._replay_position < len(self._batches):
                batch = self._batches[self._replay_position]
                self._replay_position += 1
                return batch
            self._replay_position = None
        batch = next(self.iterable)
        if self._recording:
            self._batches.append(batch)
        return batch

    def advance(self):
        self._batches = []
        self._replay_position = None
        self._recording = True

    def rewind(self):
        self._replay_position = 0

    def stop_recording(self):
        """Forget the recorded batches and record none until the next `advance()` (reruns are off)."""
        self._batches = []
        self._replay_position = None
        self._recording = False

    def recorded_batch_count(self):
        return len(self._batches)


def rerun_iterators_in(data_iterator):
    """The `RerunDataIterator`s in `data_iterator` (one iterator, a list of them per model chunk, or None)."""
    candidates = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    return [candidate for candidate in candidates if isinstance(candidate, RerunDataIterator)]


def as_rerun_iterators(data_iterator):
    """The `RerunDataIterator`s in `data_iterator` (one, a list of them per model chunk, or None; None entries
    are skipped). Any other iterator is an error: a rerun of a step drawing from it would see other data."""
    if data_iterator is None:
        return []
    candidates = data_iterator if isinstance(data_iterator, (list, tuple)) else [data_iterator]
    for candidate in candidates:
        if candidate is not None and not isinstance(candidate, RerunDataIterator):
            raise TypeError(f"the rerun state machine needs RerunDataIterator data iterators to rerun a step on the "
                            f"same data, got {type(candidate).__name__}; wrap it with wrap_for_reruns()")
    return [candidate for candidate in candidates if candidate is not None]


def wrap_for_reruns(data_iterator):
    """`data_iterator` (an iterator, a list of them per model chunk, or None) with every iterator wrapped."""
    if data_iterator is None or isinstance(data_iterator, RerunDataIterator):
        return data_iterator
    if isinstance(data_iterator, (list, tuple)):
        return [wrap_for_reruns(each) for each in data_iterator]
    return RerunDataIterator(data_iterator)
