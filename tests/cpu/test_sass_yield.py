"""scripts/sass_yield.py on a synthetic object: which instructions it rewrites, which bits, and
what it refuses. No cuobjdump needed: the SASS listing is given, the device ELF built here."""

import os
import struct
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import sass_yield  # noqa: E402

STAY = sass_yield.YIELD_BIT
REUSE_B = 1 << 59
KERNEL = "fp8_grouped_gemm_kernel_stand_in"


def device_elf(text):
    """A minimal ELF64 with .shstrtab and .text.KERNEL holding `text`."""
    names = b"\0.shstrtab\0.text." + KERNEL.encode() + b"\0"
    header_size, section_size = 64, 64
    names_at = header_size
    text_at = names_at + len(names)
    sections_at = text_at + len(text)
    header = bytearray(header_size)
    header[0:4] = b"\x7fELF"
    header[4], header[5] = 2, 1  # 64-bit, little-endian
    struct.pack_into("<Q", header, 0x28, sections_at)
    struct.pack_into("<HHH", header, 0x3A, section_size, 3, 1)

    def section(name, offset, size):
        entry = bytearray(section_size)
        struct.pack_into("<IIQQQQ", entry, 0, name, 1, 0, 0, offset, size)
        return bytes(entry)

    table = section(0, 0, 0) + section(1, names_at, len(names)) + section(11, text_at, len(text))
    return bytes(header) + names + text + table


class SassYieldTest(unittest.TestCase):
    def setUp(self):
        # A wgmma wait, 40 promotion FFMA (even ones carry a reuse flag and stay, as ptxas writes
        # them), a wgmma that ends the stretch, then one more FFMA outside any stretch.
        self.listing = [(KERNEL, 0x0, "WARPGROUP.DEPBAR.LE gsb0, 0x1", 0x1111, 0x2222)]
        for i in range(40):
            high = (STAY | REUSE_B | i) if i % 2 == 0 else i
            self.listing.append((KERNEL, 0x10 * (i + 1), f"FFMA R{i}, R2, R3, R{i}", 0x7223, high))
        after = 0x10 * 41
        self.listing.append((KERNEL, after, "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR8]", 1, 2))
        self.listing.append((KERNEL, after + 0x10, "FFMA R9, R2, R3, R9", 0x7223, STAY | REUSE_B))
        text = b"".join(struct.pack("<QQ", low, high) for *_, low, high in self.listing)
        self.prefix = b"host object bytes"
        self.directory = tempfile.TemporaryDirectory()
        self.object = os.path.join(self.directory.name, "kernel.o")
        with open(self.object, "wb") as f:
            f.write(self.prefix + device_elf(text))
        sass_yield.listing = lambda _: self.listing

    def tearDown(self):
        self.directory.cleanup()

    def instructions_after(self, path):
        with open(path, "rb") as f:
            data = f.read()
        ((_, sections),) = sass_yield.embedded_elfs(data)
        offset, _ = sections[".text." + KERNEL]
        return [
            struct.unpack_from("<QQ", data, offset + address) for _, address, *_ in self.listing
        ]

    def test_every_promotion_instruction_yields_without_reuse(self):
        out = self.object + ".patched"
        self.assertEqual(sass_yield.patch(self.object, out, "all", "fp8_grouped_gemm"), 20)
        after = self.instructions_after(out)
        for (_, _, text, low, high), (new_low, new_high) in zip(self.listing, after):
            self.assertEqual(new_low, low, text)
        for i in range(40):
            high = self.listing[1 + i][4]
            self.assertEqual(after[1 + i][1], high & ~STAY & ~REUSE_B, f"FFMA {i}")
        self.assertEqual(after[0], (0x1111, 0x2222))  # the wait
        self.assertEqual(after[-1][1], STAY | REUSE_B)  # outside the stretch: as compiled

    def test_first_half_leaves_the_second_half(self):
        out = self.object + ".patched"
        self.assertEqual(sass_yield.patch(self.object, out, "first-half", "fp8_grouped_gemm"), 10)
        after = self.instructions_after(out)
        self.assertEqual(after[1 + 20][1], self.listing[1 + 20][4])
        self.assertEqual(after[1 + 18][1], self.listing[1 + 18][4] & ~STAY & ~REUSE_B)

    def test_refuses_bytes_that_differ_from_the_listing(self):
        self.listing[5] = self.listing[5][:3] + (0x9999, self.listing[5][4])
        with self.assertRaises(SystemExit):
            sass_yield.patch(self.object, self.object + ".patched", "all", "fp8_grouped_gemm")

    def test_refuses_an_object_without_an_uncompressed_device_elf(self):
        with open(self.object, "wb") as f:
            f.write(b"\x7fELF host header only" + b"\0" * 64)
        with self.assertRaises(SystemExit):
            sass_yield.patch(self.object, self.object + ".patched", "all", "fp8_grouped_gemm")


if __name__ == "__main__":
    unittest.main()
