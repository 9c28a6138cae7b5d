"""`POST /v1/ocr`: text of an image or a PDF, page by page (a PDF's pages fan out over the model's holders)."""

from __future__ import annotations

from litestar import Request, Response, post

from coderai.contracts import OcrJob, OcrResult, RequestId
from coderai.gateway.http import json_response, new_request_id
from coderai.gateway.openai import formats
from coderai.gateway.openai.forms import blob, read_form
from coderai.gateway.pipeline import Call, answer
from coderai.gateway.state import InferenceController


class OcrController(InferenceController):
    @post("/v1/ocr", status_code=200)
    async def ocr(self, request: Request) -> Response:
        who = self.caller(request)
        form = await read_form(request, self.gw.settings.max_upload_bytes)
        job = OcrJob(request_id=RequestId(new_request_id()), model=form.require("model"), file=blob(form.file("file")))
        call = Call(self.gw, who, "ocr", job)
        final = await answer(call, request)
        return json_response(formats.ocr(formats.result(final, OcrResult), job.model), headers=call.response_headers())
