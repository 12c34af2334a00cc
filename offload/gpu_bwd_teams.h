/* The tensor-core backward's team functions: dQ (gpu_dq_teams.h) and
 * dK/dV (gpu_dkv_teams.h), launched by gpu_mma_bwd.c. */
#ifndef FORKATTN_GPU_BWD_TEAMS_H
#define FORKATTN_GPU_BWD_TEAMS_H
#include "gpu_dkv_teams.h"
#include "gpu_dq_teams.h"

/* The names the launcher (gpu_mma_bwd.c) uses. */
#define FA_WG2_DQ_SMEM FA_WG_PAIR_DQ_SMEM
#define fa_wg2_dq_ring fa_wg_pair_dq_ring
#define fa_wg2_dq_team fa_wg_pair_dq_team
#define FA_WG2_DKV_SMEM FA_WG_PAIR_DKV_SMEM
#define fa_wg2_dkv_qm_team fa_wg_pair_dkv_query_major_team
#define FA_WG_DKV_QM_BQ FA_DKV_QUERY_MAJOR_BQ
#endif
