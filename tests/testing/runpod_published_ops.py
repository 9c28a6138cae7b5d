"""RunPod's published GraphQL operations for pods and GPU types, vendored for the fake's contract test.

Two sources, each pinned:

- RunPod's GraphQL docs, "Manage Pods" (https://docs.runpod.io/sdks/graphql/manage-pods), from the docs' source
  repository github.com/runpod/docs, file `sdks/graphql/manage-pods.mdx`:
  - `DOCS`: at commit a900806e253c4f8c16da27d1a4370e72456da4cb (2026-08-20); the file's last change there is
    e979ee423306ab12795001df8e7e245407302321 (2026-07-20).
  - `DOCS_SPOT`: at commit eb33022ae014d3e85cfdc94191278ae1a9c30014 (2026-05-01), the last revision with the spot
    sections (`podRentInterruptable`, `minimumBidPrice`), which 8e5aebdb3740725f1f0d080d1f112ba8267e20ee
    (2026-05-06, "Remove all spot pod and interruptible pod references from docs") took out of the guide; the API
    keeps them (the pod broker rents spot pods with `podRentInterruptable`).
    That revision also documents `podBidResume` (resume a spot pod with a bid); it is not vendored: the fake has no
    such mutation and nothing here sends it.
- The `runpod` Python SDK 1.12.0 (PyPI; github.com/runpod/runpod-python tag v1.12.0, commit
  07fc6e2b02b6a97a0e94fbdcf53c66949c1a6164, 2026-08-10): `runpod/api/queries/gpus.py`, `runpod/api/queries/pods.py`
  and `runpod/api/mutations/pods.py`, rendered with the arguments in `sdk` (what `runpod.create_pod(...)` etc. send
  for them). `podTerminate` is published only here: the docs guide has no terminate example.

Each operation is the docs' GraphQL tab (or the SDK's string) as written; `outputs` are the docs' "Output" tabs as
written (JSON), empty where the docs show none (the SDK documents no outputs). `YOUR_POD_ID`, the docs' placeholder,
stands for a pod's id; the test puts a real one in its place.
"""

from __future__ import annotations

from dataclasses import dataclass

SDK_VERSION = "1.12.0"
DOCS_URL = "https://docs.runpod.io/sdks/graphql/manage-pods"
DOCS_FILE = "runpod/docs:sdks/graphql/manage-pods.mdx"
DOCS = f"{DOCS_URL} ({DOCS_FILE} @ a900806e253c4f8c16da27d1a4370e72456da4cb, 2026-08-20)"
DOCS_SPOT = f"{DOCS_URL} ({DOCS_FILE} @ eb33022ae014d3e85cfdc94191278ae1a9c30014, 2026-05-01)"
SDK = f"runpod=={SDK_VERSION} (runpod/runpod-python @ v1.12.0, 07fc6e2b02b6a97a0e94fbdcf53c66949c1a6164)"
POD_ID = "YOUR_POD_ID"


@dataclass(frozen=True)
class PublishedOp:
    """One published operation. `needs`: what must exist before it runs ("" nothing, "pod" a running pod whose id
    replaces YOUR_POD_ID, "stopped" a stopped one). `sdk`: (module, attribute, args) that renders `query` in the
    SDK (args None: the attribute is the query string itself)."""

    name: str
    source: str
    query: str
    outputs: tuple[str, ...] = ()
    needs: str = ""
    sdk: tuple[str, str, tuple | None] | None = None


DOCS_OPS: tuple[PublishedOp, ...] = (
    # ---- runpod/docs, sdks/graphql/manage-pods.mdx (current) ----
    PublishedOp(
        "docs: Create a Pod",
        DOCS,
        """
mutation {
  podFindAndDeployOnDemand(
    input: {
      cloudType: ALL
      gpuCount: 1
      volumeInGb: 40
      containerDiskInGb: 40
      minVcpuCount: 2
      minMemoryInGb: 15
      gpuTypeId: "NVIDIA RTX A6000"
      name: "Runpod Tensorflow"
      imageName: "runpod/tensorflow"
      dockerArgs: ""
      ports: "8888/http"
      volumeMountPath: "/workspace"
      env: [{ key: "JUPYTER_PASSWORD", value: "your-password" }]
    }
  ) {
    id
    imageName
    env
    machineId
    machine {
      podHostId
    }
  }
}
""",
        (
            """
{
  "data": {
    "podFindAndDeployOnDemand": {
      "id": "50qynxzilsxoey",
      "imageName": "runpod/tensorflow",
      "env": ["JUPYTER_PASSWORD=your-password"],
      "machineId": "hpvdausak8xb",
      "machine": {
        "podHostId": "50qynxzilsxoey-64410065"
      }
    }
  }
}
""",
        ),
    ),
    PublishedOp(
        "docs: Create a Pod, filter by CUDA version",
        DOCS,
        """
mutation {
  podFindAndDeployOnDemand(
    input: {
      cloudType: ALL
      gpuCount: 1
      volumeInGb: 40
      containerDiskInGb: 40
      gpuTypeId: "NVIDIA RTX A6000"
      name: "Runpod Pytorch"
      imageName: "runpod/pytorch"
      allowedCudaVersions: ["12.0", "12.1", "12.2", "12.3"]
    }
  ) {
    id
    imageName
    machineId
  }
}
""",
    ),
    PublishedOp(
        "docs: Start a Pod",
        DOCS,
        """
mutation {
  podResume(input: { podId: "YOUR_POD_ID", gpuCount: 1 }) {
    id
    desiredStatus
    imageName
  }
}
""",
        (
            """
{
  "data": {
    "podResume": {
      "id": "YOUR_POD_ID",
      "desiredStatus": "RUNNING",
      "imageName": "runpod/tensorflow"
    }
  }
}
""",
        ),
        needs="stopped",
    ),
    PublishedOp(
        "docs: Start a Pod, filter by CUDA version",
        DOCS,
        """
mutation {
  podResume(input: {
    podId: "YOUR_POD_ID",
    gpuCount: 1,
    allowedCudaVersions: ["12.0", "12.1", "12.2", "12.3"]
  }) {
    id
    desiredStatus
  }
}
""",
        needs="stopped",
    ),
    PublishedOp(
        "docs: Stop a Pod",
        DOCS,
        """
mutation {
  podStop(input: { podId: "YOUR_POD_ID" }) {
    id
    desiredStatus
  }
}
""",
        (
            """
{
  "data": {
    "podStop": {
      "id": "YOUR_POD_ID",
      "desiredStatus": "EXITED"
    }
  }
}
""",
        ),
        needs="pod",
    ),
    PublishedOp(
        "docs: List all Pods",
        DOCS,
        """
query {
  myself {
    pods {
      id
      name
      runtime {
        uptimeInSeconds
        ports {
          ip
          isIpPublic
          privatePort
          publicPort
          type
        }
        gpus {
          id
          gpuUtilPercent
          memoryUtilPercent
        }
        container {
          cpuPercent
          memoryPercent
        }
      }
    }
  }
}
""",
        (
            """
{
  "data": {
    "myself": {
      "pods": [
        {
          "id": "ldl1dxirsim64n",
          "name": "Runpod Pytorch",
          "runtime": {
            "uptimeInSeconds": 3931,
            "ports": [
              {
                "ip": "100.65.0.101",
                "isIpPublic": false,
                "privatePort": 8888,
                "publicPort": 60141,
                "type": "http"
              }
            ],
            "gpus": [
              {
                "id": "GPU-e0488b7e-6932-795b-a125-4472c16ea72c",
                "gpuUtilPercent": 0,
                "memoryUtilPercent": 0
              }
            ],
            "container": {
              "cpuPercent": 0,
              "memoryPercent": 0
            }
          }
        }
      ]
    }
  }
}
""",
        ),
        needs="pod",
    ),
    PublishedOp(
        "docs: Get Pod by ID",
        DOCS,
        """
query {
  pod(input: { podId: "YOUR_POD_ID" }) {
    id
    name
    runtime {
      uptimeInSeconds
      ports {
        ip
        isIpPublic
        privatePort
        publicPort
        type
      }
      gpus {
        id
        gpuUtilPercent
        memoryUtilPercent
      }
      container {
        cpuPercent
        memoryPercent
      }
    }
  }
}
""",
        (
            """
{
  "data": {
    "pod": {
      "id": "YOUR_POD_ID",
      "name": "Runpod Pytorch",
      "runtime": {
        "uptimeInSeconds": 11,
        "ports": [
          {
            "ip": "100.65.0.101",
            "isIpPublic": false,
            "privatePort": 8888,
            "publicPort": 60141,
            "type": "http"
          }
        ],
        "gpus": [
          {
            "id": "GPU-e0488b7e-6932-795b-a125-4472c16ea72c",
            "gpuUtilPercent": 0,
            "memoryUtilPercent": 0
          }
        ],
        "container": {
          "cpuPercent": 0,
          "memoryPercent": 0
        }
      }
    }
  }
}
""",
        ),
        needs="pod",
    ),
    PublishedOp(
        "docs: List all GPU types",
        DOCS,
        """
query {
  gpuTypes {
    id
    displayName
    memoryInGb
  }
}
""",
        (
            """
{
  "data": {
    "gpuTypes": [
      {
        "id": "NVIDIA GeForce RTX 3070",
        "displayName": "RTX 3070",
        "memoryInGb": 8
      },
      {
        "id": "NVIDIA GeForce RTX 3080",
        "displayName": "RTX 3080",
        "memoryInGb": 10
      },
      {
        "id": "NVIDIA RTX A6000",
        "displayName": "RTX A6000",
        "memoryInGb": 48
      }
    ]
  }
}
""",
        ),
    ),
    PublishedOp(
        "docs: Get GPU type details",
        DOCS,
        """
query {
  gpuTypes(input: { id: "NVIDIA GeForce RTX 3090" }) {
    id
    displayName
    memoryInGb
    secureCloud
    communityCloud
    lowestPrice(input: { gpuCount: 1 }) {
      uninterruptablePrice
    }
  }
}
""",
        (
            """
{
  "data": {
    "gpuTypes": [
      {
        "id": "NVIDIA GeForce RTX 3090",
        "displayName": "RTX 3090",
        "memoryInGb": 24,
        "secureCloud": false,
        "communityCloud": true,
        "lowestPrice": {
          "uninterruptablePrice": 0.3
        }
      }
    ]
  }
}
""",
        ),
    ),
    PublishedOp(
        "docs: Check GPU availability",
        DOCS,
        """
query {
  gpuTypes(input: { id: "NVIDIA RTX A4000" }) {
    id
    displayName
    lowestPrice(input: { gpuCount: 1, secureCloud: true }) {
      stockStatus
      uninterruptablePrice
      availableGpuCounts
    }
  }
}
""",
        (
            """
{
  "data": {
    "gpuTypes": [
      {
        "id": "NVIDIA RTX A4000",
        "displayName": "RTX A4000",
        "lowestPrice": {
          "stockStatus": "High",
          "uninterruptablePrice": 0.35,
          "availableGpuCounts": [1, 2, 4]
        }
      }
    ]
  }
}
""",
            """
{
  "data": {
    "gpuTypes": [
      {
        "id": "NVIDIA RTX A4000",
        "displayName": "RTX A4000",
        "lowestPrice": {
          "stockStatus": "Low",
          "uninterruptablePrice": 0.24,
          "availableGpuCounts": [1, 2, 3, 4, 5, 6, 7]
        }
      }
    ]
  }
}
""",
        ),
    ),
    # ---- runpod/docs, sdks/graphql/manage-pods.mdx (the last revision with the spot sections) ----
    PublishedOp(
        "docs (spot): Create a Pod, spot",
        DOCS_SPOT,
        """
mutation {
  podRentInterruptable(
    input: {
      bidPerGpu: 0.2
      cloudType: SECURE
      gpuCount: 1
      volumeInGb: 40
      containerDiskInGb: 40
      minVcpuCount: 2
      minMemoryInGb: 15
      gpuTypeId: "NVIDIA RTX A6000"
      name: "Runpod Pytorch"
      imageName: "runpod/pytorch"
      dockerArgs: ""
      ports: "8888/http"
      volumeMountPath: "/workspace"
      env: [{ key: "JUPYTER_PASSWORD", value: "your-password" }]
    }
  ) {
    id
    imageName
    env
    machineId
    machine {
      podHostId
    }
  }
}
""",
        (
            """
{
  "data": {
    "podRentInterruptable": {
      "id": "fkjbybgpwuvmhk",
      "imageName": "runpod/pytorch",
      "env": ["JUPYTER_PASSWORD=your-password"],
      "machineId": "hpvdausak8xb",
      "machine": {
        "podHostId": "fkjbybgpwuvmhk-64410065"
      }
    }
  }
}
""",
        ),
    ),
    PublishedOp(
        "docs (spot): Get GPU type details, with the spot price",
        DOCS_SPOT,
        """
query {
  gpuTypes(input: { id: "NVIDIA GeForce RTX 3090" }) {
    id
    displayName
    memoryInGb
    secureCloud
    communityCloud
    lowestPrice(input: { gpuCount: 1 }) {
      minimumBidPrice
      uninterruptablePrice
    }
  }
}
""",
        (
            """
{
  "data": {
    "gpuTypes": [
      {
        "id": "NVIDIA GeForce RTX 3090",
        "displayName": "RTX 3090",
        "memoryInGb": 24,
        "secureCloud": false,
        "communityCloud": true,
        "lowestPrice": {
          "minimumBidPrice": 0.163,
          "uninterruptablePrice": 0.3
        }
      }
    ]
  }
}
""",
        ),
    ),
)
