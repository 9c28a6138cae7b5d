"""The runpod SDK's own operations (runpod==1.12.0), vendored for the fake's contract test beside RunPod's documented
ones (`runpod_published_ops.py`): the exact strings its functions send, whitespace as the SDK renders it."""

from __future__ import annotations

from tests.testing.runpod_published_ops import POD_ID, SDK, PublishedOp

SDK_OPS: tuple[PublishedOp, ...] = (
    PublishedOp(
        "sdk: get_gpus",
        SDK,
        """
query GpuTypes {
  gpuTypes {
    id
    displayName
    memoryInGb
  }
}
""",
        sdk=("runpod.api.queries.gpus", "QUERY_GPU_TYPES", None),
    ),
    PublishedOp(
        "sdk: get_gpu",
        SDK,
        """
    query GpuTypes {
      gpuTypes(input: {id: "NVIDIA RTX A6000"}) {
        maxGpuCount
        id
        displayName
        manufacturer
        memoryInGb
        cudaCores
        secureCloud
        communityCloud
        securePrice
        communityPrice
        oneMonthPrice
        threeMonthPrice
        oneWeekPrice
        communitySpotPrice
        secureSpotPrice
        lowestPrice(input: {gpuCount: 1}) {
          minimumBidPrice
          uninterruptablePrice
        }
      }
    }
    """,
        sdk=("runpod.api.queries.gpus", "generate_gpu_query", ("NVIDIA RTX A6000", 1)),
    ),
    PublishedOp(
        "sdk: get_pods",
        SDK,
        """
query myPods {
    myself {
        pods {
            id
            containerDiskInGb
            costPerHr
            desiredStatus
            dockerArgs
            dockerId
            env
            gpuCount
            imageName
            lastStatusChange
            machineId
            memoryInGb
            name
            podType
            port
            ports
            uptimeSeconds
            vcpuCount
            volumeInGb
            volumeMountPath
            runtime {
                ports{
                    ip
                    isIpPublic
                    privatePort
                    publicPort
                    type
                }
            }
            machine {
                gpuDisplayName
            }
        }
    }
}
""",
        needs="pod",
        sdk=("runpod.api.queries.pods", "QUERY_POD", None),
    ),
    PublishedOp(
        "sdk: get_pod",
        SDK,
        """
    query pod {
        pod(input: {podId: "YOUR_POD_ID"}) {
            id
            containerDiskInGb
            costPerHr
            desiredStatus
            dockerArgs
            dockerId
            env
            gpuCount
            imageName
            lastStatusChange
            machineId
            memoryInGb
            name
            podType
            port
            ports
            uptimeSeconds
            vcpuCount
            volumeInGb
            volumeMountPath
            runtime {
                ports {
                    ip
                    isIpPublic
                    privatePort
                    publicPort
                    type
                }
            }
            machine {
                gpuDisplayName
            }
        }
    }
    """,
        needs="pod",
        sdk=("runpod.api.queries.pods", "generate_pod_query", (POD_ID,)),
    ),
    # runpod.create_pod("Runpod Tensorflow", "runpod/tensorflow", "NVIDIA RTX A6000",
    #                   env={"JUPYTER_PASSWORD": "your-password"}) with create_pod's defaults:
    PublishedOp(
        "sdk: create_pod",
        SDK,
        """
    mutation {
      podFindAndDeployOnDemand(
        input: {
          name: "Runpod Tensorflow", imageName: "runpod/tensorflow", cloudType: ALL, startSsh: true, gpuTypeId: "NVIDIA RTX A6000", supportPublicIp: true, gpuCount: 1, volumeInGb: 0, minVcpuCount: 1, minMemoryInGb: 1, dataCenterId: null, dockerArgs: "", containerDiskInGb: 10, volumeMountPath: "/runpod-volume", env: [{ key: "JUPYTER_PASSWORD", value: "your-password" }]
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
        sdk=(
            "runpod.api.mutations.pods",
            "generate_pod_deployment_mutation",
            (
                "Runpod Tensorflow",
                "runpod/tensorflow",
                "NVIDIA RTX A6000",
                "ALL",
                True,
                True,
                None,
                None,
                1,
                0,
                10,
                1,
                1,
                "",
                None,
                "/runpod-volume",
                {"JUPYTER_PASSWORD": "your-password"},
                None,
                None,
                None,
                None,
                None,
                None,
            ),
        ),
    ),
    PublishedOp(
        "sdk: stop_pod",
        SDK,
        """
    mutation {
        podStop(input: { podId: "YOUR_POD_ID" }) {
            id
            desiredStatus
        }
    }
    """,
        needs="pod",
        sdk=("runpod.api.mutations.pods", "generate_pod_stop_mutation", (POD_ID,)),
    ),
    PublishedOp(
        "sdk: resume_pod",
        SDK,
        """
    mutation {
        podResume(input: { podId: "YOUR_POD_ID", gpuCount: 1 }) {
            id
            desiredStatus
            imageName
            env
            machineId
            machine {
                podHostId
            }
        }
    }
    """,
        needs="stopped",
        sdk=("runpod.api.mutations.pods", "generate_pod_resume_mutation", (POD_ID, 1)),
    ),
    PublishedOp(
        "sdk: terminate_pod",
        SDK,
        """
    mutation {
        podTerminate(input: { podId: "YOUR_POD_ID" })
    }
    """,
        needs="pod",
        sdk=("runpod.api.mutations.pods", "generate_pod_terminate_mutation", (POD_ID,)),
    ),
)
