#!/usr/bin/env python3
"""The VM rig's checker must pass what the contract allows and fail what it forbids.

Run: python3 -m unittest discover -s tests/vm -p 'test_*.py'  (cargo test runs it too:
tests/vm_rig.rs).
"""
import os
import shutil
import tempfile
import unittest

import workload as w


def state_after(seed, n):
    """The directory after operations 0..n-1, and operation n."""
    model = {}
    for i, op in w.operations(seed):
        if i == n:
            return model, op
        w.apply(model, op)


def materialize(d, state):
    shutil.rmtree(d)
    os.mkdir(d)
    for n, v in sorted(state.items(), key=lambda kv: kv[1] != w.DIR):  # directories first
        p = os.path.join(d, n)
        if v == w.DIR:
            os.mkdir(p)
        elif isinstance(v, tuple):
            os.symlink(v[1], p)
        else:
            with open(p, "wb") as f:
                f.write(v)


class Checker(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.d = os.path.join(self.tmp, "c0")
        os.mkdir(self.d)

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def test_the_writer_s_own_directory_passes(self):
        shutil.rmtree(self.d)
        console = os.path.join(self.tmp, "console")
        w.writer("t", self.d, 7, True, 0.3, console)
        with open(console) as f:
            acks = [l for l in f.read().split("\n") if l.startswith("@@ACK")]
        self.assertGreater(len(acks), 5)
        ok, msg = w.check(self.d, 7, len(acks))
        self.assertTrue(ok, msg)

    def test_writers_as_threads_of_one_process_each_pass(self):
        shutil.rmtree(self.d)
        console = os.path.join(self.tmp, "console")
        dirs = {n: os.path.join(self.tmp, n) for n in ("a", "b")}
        args = ["1", "0.3", console] + [x for n, seed in (("a", 7), ("b", 8)) for x in (n, dirs[n], str(seed))]
        self.assertEqual(w.main(["workload.py", "write-threads"] + args), 0)
        with open(console) as f:
            lines = f.read().split("\n")
        for n, seed in (("a", 7), ("b", 8)):
            acks = [l for l in lines if l.startswith("@@ACK %s " % n)]
            self.assertGreater(len(acks), 5, n)
            self.assertIn("@@WRITER-END %s@@" % n, lines)
            ok, msg = w.check(dirs[n], seed, len(acks))
            self.assertTrue(ok, "%s: %s" % (n, msg))

    def test_an_acknowledged_operation_lost_fails(self):
        # For every prefix, a directory one acknowledged operation short must fail unless
        # that operation changed nothing.
        failed = 0
        for acked in range(1, 60):
            before, _ = state_after(11, acked - 1)
            after, _ = state_after(11, acked)
            materialize(self.d, before)
            ok, msg = w.check(self.d, 11, acked)
            if before != after:
                self.assertFalse(ok, "acked %d: a lost operation passed: %s" % (acked, msg))
                failed += 1
        self.assertGreater(failed, 40)

    def test_the_operation_in_flight_may_be_whole_absent_or_per_page(self):
        seen = set()
        for n in range(0, 200):
            before, op = state_after(5, n)
            after = dict(before)
            w.apply(after, op)
            materialize(self.d, before)
            self.assertTrue(w.check(self.d, 5, n)[0])
            materialize(self.d, after)
            self.assertTrue(w.check(self.d, 5, n)[0])
            if op["kind"] in ("write", "dsync") and len(op["data"]) > w.PAGE and op["off"] + len(op["data"]) <= len(before[op["name"]]):
                # The first page new, the rest old: a torn multi-page write in flight.
                mixed = dict(before)
                b = bytearray(before[op["name"]])
                b[op["off"] : op["off"] + w.PAGE] = op["data"][: w.PAGE]
                mixed[op["name"]] = bytes(b)
                materialize(self.d, mixed)
                self.assertTrue(w.check(self.d, 5, n)[0])
                seen.add("mix")
            if op["kind"] in ("write", "dsync"):
                # Bytes nobody wrote are never accepted.
                bad = dict(after)
                b = bytearray(after[op["name"]])
                b[op["off"]] ^= 0xFF
                bad[op["name"]] = bytes(b)
                materialize(self.d, bad)
                self.assertFalse(w.check(self.d, 5, n)[0])
                seen.add("bad")
        self.assertEqual(seen, {"mix", "bad"})

    def test_an_in_flight_growing_write_may_leave_zeros_past_the_old_end_only(self):
        # What tests/vm/rig met once (seed 428572448, r-fsdax.0 of its first boot): a create
        # in flight at the cut, the file back with its new size and zeros, which ext4 itself
        # leaves (it commits the size of pages under write-back before their bytes). Allowed
        # for the operation in flight, past the old end of the file; never for an
        # acknowledged one, never below the old end, never another writer's bytes.
        before, op = state_after(1642847845, 171)
        self.assertEqual((op["kind"], op["name"], len(op["data"])), ("create", "f08", 4718))
        torn = dict(before)
        torn["f08"] = bytes(4718)
        materialize(self.d, torn)
        self.assertTrue(w.check(self.d, 1642847845, 171)[0])
        ok, msg = w.check(self.d, 1642847845, 172)
        self.assertFalse(ok, msg)
        self.assertIn("f08 differs: 4718 bytes, want 4718", msg)
        self.assertIn("pages 4718 bytes [zeros, zeros], want 4718 bytes [op171 p0, op171 p1]", msg)
        seen = set()
        for n in range(0, 400):
            before, op = state_after(5, n)
            if op["kind"] not in ("write", "dsync"):
                continue
            old, name = before[op["name"]], op["name"]
            after = dict(before)
            w.apply(after, op)
            new = after[name]
            if len(new) <= len(old) or op["off"] >= len(old):
                continue
            # The write's pages past the old end absent: old bytes up to the old end,
            # zeros after, at the new size and at each page boundary between.
            for size in sorted({len(new)} | set(range((len(old) // w.PAGE + 1) * w.PAGE, len(new), w.PAGE))):
                torn = dict(before)
                torn[name] = (old + bytes(len(new)))[:size]
                materialize(self.d, torn)
                self.assertTrue(w.check(self.d, 5, n)[0], "op %d, size %d" % (n, size))
                self.assertFalse(w.check(self.d, 5, n + 1)[0], "op %d acknowledged, size %d" % (n, size))
                seen.add("grown")
            # Zeros below the old end, where the write did not reach: fails.
            if op["off"] >= w.PAGE:
                bad = dict(before)
                bad[name] = bytes(w.PAGE) + new[w.PAGE :]
                materialize(self.d, bad)
                self.assertFalse(w.check(self.d, 5, n)[0], "op %d: old bytes lost" % n)
                seen.add("below")
            # A size that is no page boundary between the two: fails.
            if len(new) - len(old) > 2:
                bad = dict(before)
                bad[name] = new[: len(old) + 1] if (len(old) + 1) % w.PAGE else new[: len(old) + 2]
                materialize(self.d, bad)
                self.assertFalse(w.check(self.d, 5, n)[0], "op %d: size %d" % (n, len(bad[name])))
                seen.add("size")
        self.assertEqual(seen, {"grown", "below", "size"})

    def test_histories_reach_every_kind_of_operation(self):
        kinds = {op["kind"] for _, (_, op) in zip(range(3000), w.operations(9))}
        self.assertEqual(kinds, {"create", "symlink", "write", "dsync", "truncate", "fallocate", "rename",
                                 "unlink", "mkdir", "rmdir"})

    def test_a_name_the_log_removed_coming_back_fails(self):
        for n in range(1, 300):
            before, op = state_after(3, n)
            if op["kind"] == "unlink":
                after = dict(before)
                w.apply(after, op)
                # Acknowledged unlink (acked n+1), name back.
                materialize(self.d, before)
                self.assertFalse(w.check(self.d, 3, n + 1)[0])
                return
        self.fail("no unlink in 300 operations")

    def test_an_in_flight_truncate_torn_by_replay_fails_and_says_where(self):
        # What tests/vm/rig once found: a truncate in flight, the file back at its old size
        # with the tail of the new last page zeroed (older log entries replayed over the
        # lower's durable truncate). Neither side of the truncate: it must fail, and the
        # message must point at the first byte that differs, not only at the page header.
        for n in range(1, 400):
            before, op = state_after(5, n)
            old = before.get(op["name"])
            if op["kind"] != "truncate" or not w.is_file(old) or op["size"] % w.PAGE == 0 or op["size"] >= len(old):
                continue
            torn = dict(before)
            end = min(len(old), (op["size"] // w.PAGE + 1) * w.PAGE)
            torn[op["name"]] = old[: op["size"]] + bytes(end - op["size"]) + old[end:]
            if torn[op["name"]] == old:
                continue
            materialize(self.d, torn)
            ok, msg = w.check(self.d, 5, n)
            self.assertFalse(ok, msg)
            self.assertIn("first difference at byte %d" % (op["size"] + next(i for i, b in enumerate(old[op["size"]:end]) if b != 0)), msg)
            return
        self.fail("no shrinking truncate to the middle of a page in 400 operations")


if __name__ == "__main__":
    unittest.main()
