"""A small ``multipart/form-data`` parser for the transcription upload.

Starlette's form parsing needs the optional ``python-multipart`` package; the upload
here is one small form held in memory, so a strict parser of the RFC 7578 subset that
HTTP clients send (CRLF line ends, ``Content-Disposition: form-data; name=...;
filename=...``, optional ``Content-Type``) is enough.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Form", "FormPart", "MultipartError", "parse_multipart"]

_PARAM = re.compile(r';\s*([A-Za-z0-9_*-]+)=(?:"((?:[^"\\]|\\.)*)"|([^;\s]+))')


class MultipartError(ValueError):
    """The body is not a well-formed multipart form."""


@dataclass(frozen=True, slots=True)
class FormPart:
    name: str
    data: bytes
    filename: str | None = None
    content_type: str = ""


class Form:
    """Parsed form fields by name (the first part of each name wins)."""

    def __init__(self, parts: list[FormPart]) -> None:
        self.parts = parts
        self._by_name: dict[str, FormPart] = {}
        for part in parts:
            self._by_name.setdefault(part.name, part)

    def get(self, name: str) -> FormPart | None:
        return self._by_name.get(name)

    def text(self, name: str) -> str:
        """A text field's value, ``""`` when absent."""
        part = self._by_name.get(name)
        return part.data.decode("utf-8", errors="replace").strip() if part else ""


def _params(header_value: str) -> dict[str, str]:
    return {
        m.group(1).lower(): (m.group(2) if m.group(2) is not None else m.group(3))
        for m in _PARAM.finditer(header_value)
    }


def parse_multipart(body: bytes, content_type: str) -> Form:
    """Parse ``body`` sent with ``content_type`` (which carries the boundary)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise MultipartError("expected a multipart/form-data upload")
    boundary = _params(content_type).get("boundary")
    if not boundary:
        raise MultipartError("multipart/form-data without a boundary")
    delimiter = b"--" + boundary.encode("latin-1")
    sections = body.split(delimiter)
    if len(sections) < 3 or not sections[-1].startswith(b"--"):
        raise MultipartError("malformed multipart body (missing closing boundary)")
    parts = []
    for section in sections[1:-1]:
        if not section.startswith(b"\r\n") or not section.endswith(b"\r\n"):
            raise MultipartError("malformed multipart part")
        head, sep, data = section[2:-2].partition(b"\r\n\r\n")
        if not sep:
            raise MultipartError("multipart part without headers")
        headers: dict[str, str] = {}
        for line in head.decode("utf-8", errors="replace").split("\r\n"):
            key, colon, value = line.partition(":")
            if colon:
                headers[key.strip().lower()] = value.strip()
        disposition = headers.get("content-disposition", "")
        params = _params(disposition)
        if not disposition.lower().startswith("form-data") or "name" not in params:
            raise MultipartError("multipart part without Content-Disposition: form-data; name")
        parts.append(
            FormPart(
                name=params["name"],
                data=data,
                filename=params.get("filename"),
                content_type=headers.get("content-type", "").lower(),
            )
        )
    return Form(parts)
