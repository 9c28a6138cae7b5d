"""The GraphQL schema of the fake RunPod API (`fake_runpod`): the types, inputs and operations the `runpod` 1.12
SDK selects (string-built queries, so every field it asks for must be here) and `coderai.pod_broker.runpod_api`
sends with variables."""

from __future__ import annotations

from graphql import build_schema

_DEPLOY_FIELDS = """name: String imageName: String cloudType: CloudTypeEnum gpuTypeId: String gpuCount: Int
  volumeInGb: Int containerDiskInGb: Int minVcpuCount: Int minMemoryInGb: Int dockerArgs: String ports: String
  volumeMountPath: String env: [EnvironmentVariableInput] startSsh: Boolean startJupyter: Boolean
  supportPublicIp: Boolean dataCenterId: String countryCode: String templateId: String networkVolumeId: String
  allowedCudaVersions: [String] minDownload: Int minUpload: Int"""
SCHEMA = build_schema(f"""
scalar Void
enum CloudTypeEnum {{ ALL SECURE COMMUNITY }}
enum PodStatus {{ CREATED RUNNING RESTARTING EXITED PAUSED DEAD TERMINATED }}
enum PodType {{ INTERRUPTABLE RESERVED BID BACKGROUND }}
input GpuTypeFilter {{ id: String ids: [String] }}
input GpuLowestPriceInput {{ gpuCount: Int secureCloud: Boolean dataCenterId: String minMemoryInGb: Int
  minVcpuCount: Int }}
input PodFilter {{ podId: String! }}
input EnvironmentVariableInput {{ key: String! value: String! }}
input PodFindAndDeployOnDemandInput {{ {_DEPLOY_FIELDS} }}
input PodRentInterruptableInput {{ bidPerGpu: Float! {_DEPLOY_FIELDS} }}
input PodStopInput {{ podId: String! incrementVersion: Boolean }}
input PodResumeInput {{ podId: String! gpuCount: Int allowedCudaVersions: [String] }}
input PodTerminateInput {{ podId: String! }}
type LowestPrice {{ minimumBidPrice: Float uninterruptablePrice: Float stockStatus: String gpuTypeId: String
  availableGpuCounts: [Int] }}
type GpuType {{ id: String! displayName: String memoryInGb: Int maxGpuCount: Int manufacturer: String
  cudaCores: Int secureCloud: Boolean communityCloud: Boolean securePrice: Float communityPrice: Float
  oneWeekPrice: Float oneMonthPrice: Float threeMonthPrice: Float secureSpotPrice: Float communitySpotPrice: Float
  lowestPrice(input: GpuLowestPriceInput): LowestPrice }}
type PodRuntimePorts {{ ip: String isIpPublic: Boolean privatePort: Int publicPort: Int type: String }}
type PodRuntimeGpus {{ id: String gpuUtilPercent: Int memoryUtilPercent: Int }}
type PodRuntimeContainer {{ cpuPercent: Int memoryPercent: Int }}
type PodRuntime {{ uptimeInSeconds: Int ports: [PodRuntimePorts] gpus: [PodRuntimeGpus]
  container: PodRuntimeContainer }}
type PodMachineInfo {{ podHostId: String gpuDisplayName: String gpuTypeId: String }}
type Pod {{ id: String! name: String desiredStatus: PodStatus imageName: String env: [String] machineId: String
  costPerHr: Float gpuCount: Int podType: PodType containerDiskInGb: Int volumeInGb: Int volumeMountPath: String
  dockerArgs: String dockerId: String lastStatusChange: String memoryInGb: Float vcpuCount: Float port: Int
  ports: String uptimeSeconds: Int runtime: PodRuntime machine: PodMachineInfo }}
type User {{ id: String pods: [Pod] }}
type Query {{ gpuTypes(input: GpuTypeFilter): [GpuType] pod(input: PodFilter): Pod myself: User }}
type Mutation {{
  podFindAndDeployOnDemand(input: PodFindAndDeployOnDemandInput): Pod
  podRentInterruptable(input: PodRentInterruptableInput!): Pod
  podStop(input: PodStopInput!): Pod
  podResume(input: PodResumeInput!): Pod
  podTerminate(input: PodTerminateInput!): Void
}}
""")
