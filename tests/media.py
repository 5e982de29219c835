"""Small, well-formed images and documents for tests: real headers, real page trees."""

from __future__ import annotations

import struct
import zlib


def png(width: int = 64, height: int = 32) -> bytes:
    """A PNG of ``width`` x ``height`` (signature, IHDR, one IDAT, IEND)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    rows = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows))
            + chunk(b"IEND", b""))


def jpeg(width: int = 640, height: int = 480) -> bytes:
    """A JPEG's header segments (SOI, APP0, SOF0 with the size, EOI)."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof0 + b"\xff\xd9"


def gif(width: int = 10, height: int = 10) -> bytes:
    """A GIF89a header with its logical screen size."""
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00;"


def webp(width: int = 100, height: int = 50) -> bytes:
    """A WebP (VP8X) header with its canvas size."""
    vp8x = b"VP8X" + struct.pack("<I", 10) + b"\x00\x00\x00\x00" + \
        (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    return b"RIFF" + struct.pack("<I", 4 + len(vp8x)) + b"WEBP" + vp8x


def pdf(pages: int = 2, text: str = "Revenue grew 12%.") -> bytes:
    """A PDF with ``pages`` pages, each showing ``text`` (uncompressed objects, a real xref)."""
    objs: list[bytes] = []
    kids = " ".join(f"{3 + 2 * i} 0 R" for i in range(pages))
    objs.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objs.append(f"<< /Type /Pages /Kids [{kids}] /Count {pages} >>".encode())
    for i in range(pages):
        content = f"BT /F1 12 Tf 72 720 Td ({text} p{i + 1}) Tj ET".encode()
        objs.append(f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                    f"/Contents {4 + 2 * i} 0 R >>".encode())
        objs.append(b"<< /Length " + str(len(content)).encode() + b" >>\nstream\n" + content
                    + b"\nendstream")
    out = bytearray(b"%PDF-1.7\n")
    offsets = []
    for n, body in enumerate(objs, start=1):
        offsets.append(len(out))
        out += f"{n} 0 obj\n".encode() + body + b"\nendobj\n"
    xref = len(out)
    out += f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n".encode()
    for off in offsets:
        out += f"{off:010d} 00000 n \n".encode()
    out += (f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n"
            .encode())
    return bytes(out)


def opaque_pdf(size: int) -> bytes:
    """A PDF whose page tree is in compressed streams: only its size tells anything."""
    return b"%PDF-1.7\n" + b"\x00" * max(0, size - 9)


def objstm_pdf(pages: int = 2, image_bytes: int = 0, *, inner: bytes | None = None,
               filters: str = "/FlateDecode") -> bytes:
    """A PDF 1.5 whose page tree is in a compressed object stream (as pdfTeX, Word, Chrome).

    Each page carries an uncompressed image stream of ``image_bytes`` (a scan); ``inner``
    replaces the object stream's inflated text (a deflate bomb, say).
    """
    page_ids = [4 + i for i in range(pages)]
    objs = {3: f"<< /Type /Pages /Kids [{' '.join(f'{p} 0 R' for p in page_ids)}] "
               f"/Count {pages} >>"}
    for n, p in enumerate(page_ids):
        resources = (f"/Resources << /XObject << /Im0 {4 + pages + n} 0 R >> >> "
                     if image_bytes else "")
        objs[p] = f"<< /Type /Page /Parent 3 0 R /MediaBox [0 0 612 792] {resources}>>"
    offsets, body = [], ""
    for n, text in objs.items():
        offsets.append(f"{n} {len(body)}")
        body += text + "\n"
    header = " ".join(offsets) + "\n"
    packed = zlib.compress((header + body).encode() if inner is None else inner)
    out = bytearray(b"%PDF-1.5\n%\xe2\xe3\xcf\xd3\n"
                    b"1 0 obj\n<< /Type /Catalog /Pages 3 0 R >>\nendobj\n")
    out += (f"2 0 obj\n<< /Type /ObjStm /N {len(objs)} /First {len(header)} /Filter {filters} "
            f"/Length {len(packed)} >>\nstream\r\n").encode() + packed + b"\nendstream\nendobj\n"
    for n in range(pages if image_bytes else 0):
        out += (f"{4 + pages + n} 0 obj\n<< /Type /XObject /Subtype /Image /Width 2550 "
                f"/Height 3300 /BitsPerComponent 8 /ColorSpace /DeviceGray /Filter /DCTDecode "
                f"/Length {image_bytes} >>\nstream\n").encode()
        out += bytes(image_bytes) + b"\nendstream\nendobj\n"
    return bytes(out + b"trailer\n<< /Root 1 0 R >>\n%%EOF\n")
